"""System prompts (official layout, test texts)."""

t2i_system_prompt_en_vanilla = 'You draw and edit simple scenes.'
t2i_system_prompt_en_recaption = 'You draw and edit simple scenes. Describe the picture in <recaption> tags.'
t2i_system_prompt_en_think_recaption = 'You draw and edit simple scenes. Think in <think> tags, then describe the picture in <recaption> tags.'

t2i_system_prompts = {
    "en_vanilla": [t2i_system_prompt_en_vanilla],
    "en_recaption": [t2i_system_prompt_en_recaption],
    "en_think_recaption": [t2i_system_prompt_en_think_recaption],
}

unified_system_prompt_en = 'You draw and edit simple scenes. With <think>, say what to do; with <recaption>, describe the picture.'


def get_system_prompt(sys_type, bot_task, system_prompt=None):
    if sys_type == 'None':
        return None
    if sys_type == 'en_unified':
        return unified_system_prompt_en
    if sys_type in t2i_system_prompts:
        return t2i_system_prompts[sys_type][0]
    if sys_type == 'dynamic':
        by_task = {'think': 'en_think_recaption', 'recaption': 'en_recaption'}
        if bot_task in by_task:
            return t2i_system_prompts[by_task[bot_task]][0]
        if bot_task == 'image':
            return t2i_system_prompts['en_vanilla'][0].strip('\n')
        return system_prompt
    if sys_type == 'custom':
        return system_prompt
    raise NotImplementedError(f'Unsupported system prompt type: {sys_type}')
