"""Functions the launcher tests run on several ranks (importable by spawned processes)."""

from __future__ import annotations

import os
import signal
import time


def sum_ranks(value: int, device: str, parallel) -> int:
    import torch

    t = torch.tensor([float(value + parallel.rank)])
    parallel.all_reduce_(t)
    return int(t.item())


def fail_on_rank(bad_rank: int, how: str, device: str, parallel, marker_dir: str | None = None) -> str:
    """Rank `bad_rank` raises or dies; the others block in a collective, then sleep 30 s and leave
    `marker_dir/rank{r}.finished` when they return (a pool that waited for them would see it)."""
    import torch

    if parallel.rank == bad_rank:
        if how == "raise":
            raise ValueError("row 3: this rank could not read its weights")
        os.kill(os.getpid(), signal.SIGKILL)
    # the healthy ranks block in a collective the failed rank never joins
    t = torch.ones(1)
    parallel.all_reduce_(t)
    time.sleep(30)
    if marker_dir:
        open(os.path.join(marker_dir, f"rank{parallel.rank}.finished"), "w").close()
    return "should not get here"


def engine_row(outdir: str, device: str, parallel) -> None:
    """One tiny IT2I row (greedy AR, 2 DiT steps with CFG) on this rank; writes what it computed."""
    import pickle

    import numpy as np
    import torch

    from components.engine import Engine
    from components.engine.ar import ARRequest, SamplingParams
    from components.engine.dit import DiTRequest
    from tests.test_engine_helpers import random_image

    torch.manual_seed(0)
    engine = Engine.load("tiny", device=device, tensor_parallel_size=parallel.world_size, parallel=parallel)
    image = random_image(96, 64)
    rows_seen = []
    plain = engine.dit.prefix_from_reuse

    def recording(*args, **kwargs):
        cache = plain(*args, **kwargs)
        rows_seen.append(cache.k[0].shape[0])
        return cache

    engine.dit.prefix_from_reuse = recording
    ar = engine.generate_ar([ARRequest("r", "a red cat on a sofa", [image], seed=1)],
                            SamplingParams(temperature=0.0, max_new_tokens=6))[0]
    dit = engine.dit(DiTRequest(ar, [image], ar.prompt_kv, steps=2, guidance_scale=5.0, seed=1))
    name = f"rank{parallel.cfg_rank}_{parallel.rank}.pkl"
    with open(f"{outdir}/{name}", "wb") as f:
        pickle.dump({"latents": dit.latents, "kv_path": dit.kv_path, "image": np.asarray(dit.image),
                     "cache_rows": rows_seen}, f)


def dit_killing_rank1(parallel, **kwargs) -> dict:
    """The DiT step, with rank 1 killed (SIGKILL) once it finished its first row."""
    if parallel.rank == 1:
        _kill_after_first_row()
    from components.dit.run import run

    return run(parallel=parallel, **kwargs)


_calls = 0


def count_calls(device: str, parallel) -> int:
    """How many times this rank process has run a task (a RankPool keeps its processes)."""
    global _calls
    _calls += 1
    return _calls


def mark_at_exit(marker_dir: str, device: str, parallel) -> None:
    """Register an exit handler that leaves rank<r> in marker_dir (a rank's exit still runs them)."""
    import atexit
    from pathlib import Path

    rank = parallel.rank if parallel is not None else 0
    atexit.register(lambda: (Path(marker_dir) / f"rank{rank}").write_text("exited"))


def engine_identity(device: str, parallel) -> int:
    """id() of the tiny TP engine that models.load_engine gives this rank (cached per rank)."""
    from components.models import load_engine

    return id(load_engine("tiny", None, device, None, tensor_parallel_size=parallel.world_size, parallel=parallel))


def fp8_checkpoint_logits(checkpoint: str, device: str, parallel) -> dict:
    """Load the tiny model from an FP8 checkpoint on this rank's slices; check every tensor it holds
    is bitwise the matching slice of the unsliced model loaded from the same checkpoint (scales
    follow output rows, whole for row-parallel weights; experts by global id); return the logits."""
    import torch

    from components.engine import Engine
    from tests.test_engine_fp8 import _tp_logits_and_latents

    engine = Engine.load(checkpoint, device=device, tensor_parallel_size=parallel.world_size, parallel=parallel)
    full = Engine.load(checkpoint, device=device).model.state_dict()
    slices = engine.model.load_slices
    for name, local in engine.model.state_dict().items():
        ref = full[name]
        owner = name.removesuffix("_scale")
        if name in slices.experts or owner in slices.experts:
            first, end = slices.experts.get(name) or slices.experts[owner]
            ref = ref[first:end]
        spec = slices.ranges.get(name) or slices.ranges.get(owner)
        if spec is not None and (spec[0] < ref.dim() and ref.shape[spec[0]] == spec[2]):
            if not (name.endswith("_scale") and spec[0] != 0):  # a row-parallel weight's scale stays whole
                ref = torch.cat([ref.narrow(spec[0], a, b - a) for a, b in spec[1]], dim=spec[0])
        same = ref.shape == local.shape and torch.equal(ref.view(torch.uint8) if ref.element_size() == 1 else ref,
                                                        local.view(torch.uint8) if local.element_size() == 1 else local)
        if not same:
            raise AssertionError(f"rank {parallel.rank}: {name} is not its slice of the unsliced model")
    return _tp_logits_and_latents(engine)


def pipeline_row(outdir: str, device: str, parallel, kv_file: str | None = None) -> None:
    """`engine_row` on a pipeline-parallel rank: one tiny IT2I row (greedy AR, 2 DiT steps with
    CFG) through the DiT's reuse path (this stage's exported K/V) and its recompute path; with
    `kv_file`, a whole-model PromptKV (another layout's AR) sliced to this rank's layers and heads
    for the reuse path. Writes what it computed to rank{pp_rank}_{rank}.pkl."""
    import pickle

    import numpy as np
    import torch

    from components.engine import Engine
    from components.engine.ar import ARRequest, SamplingParams
    from components.engine.dit import DiTRequest
    from components.kvparts import slice_kv
    from tests.test_engine_helpers import random_image

    torch.manual_seed(0)
    engine = Engine.load("tiny", device=device, tensor_parallel_size=parallel.world_size,
                         pipeline_parallel_size=parallel.pp_size, parallel=parallel)
    image = random_image(96, 64)
    ar = engine.generate_ar([ARRequest("r", "a red cat on a sofa", [image], seed=1)],
                            SamplingParams(temperature=0.0, max_new_tokens=6))[0]
    kv = ar.prompt_kv
    if kv_file:
        from components.kvparts import rank_heads

        h0, h1, _, _ = rank_heads(engine)
        kv = slice_kv(pickle.load(open(kv_file, "rb")), h0, h1, engine.model.stage_layers)
    reuse = engine.dit(DiTRequest(ar, [image], kv, steps=2, guidance_scale=5.0, seed=1))
    recompute = engine.dit(DiTRequest(ar, [image], None, steps=2, guidance_scale=5.0, seed=1))
    with open(f"{outdir}/rank{parallel.pp_rank}_{parallel.rank}.pkl", "wb") as f:
        pickle.dump({"tokens": ar.generated_ids, "kv": ar.prompt_kv, "layers": engine.model.stage_layers,
                     "compiled_decode": _decode_went_through_compiled_regions(),
                     "reuse": (reuse.latents, np.asarray(reuse.image), reuse.kv_path, reuse.kv_reason),
                     "recompute": (recompute.latents, np.asarray(recompute.image), recompute.kv_path)}, f)


def scheduler_rows() -> list:
    """tests/test_ar_scheduler's six think_recaption rows (edit and T2I), two whose first token
    comes from their prefill's logits (a text answer and a ratio-only row), and an edit row whose
    image is not one (it fails alone)."""
    from components.engine.ar import ARRequest
    from tests.test_ar_scheduler import _requests

    return _requests(6) + [ARRequest("answer", "what is a fox?", [], bot_task="auto", seed=3),
                           ARRequest("ratio", "a tall tower", [], bot_task="image", seed=4),
                           ARRequest("broken", "make it blue", ["not an image"], seed=5)]


def pipeline_scheduler(outdir: str, device: str, parallel, row_groups: str = "auto") -> None:
    """The continuous-batching AR scheduler on a pipeline-parallel rank: `scheduler_rows` (forced CoT
    lengths, greedy) with 4 rows in flight (`row_groups`: the stage_row_groups kernel setting);
    writes each row's tokens and this stage's K/V, and the scheduler's statistics."""
    import pickle

    from components.engine import Engine, kernels
    from components.engine.ar import ForcedCot
    from components.engine.ar_scheduler import Admission
    from tests.test_ar_scheduler import CHUNK, FORCED, GREEDY

    engine = Engine.load("tiny", seed=0, device=device, tensor_parallel_size=parallel.world_size,
                         pipeline_parallel_size=parallel.pp_size, parallel=parallel)
    engine.ar.forced_cot = ForcedCot(FORCED)
    kernels.configure(stage_row_groups=row_groups)
    results: dict = {}
    stats = engine.ar.stream(scheduler_rows(), lambda req, out: results.__setitem__(req.id, out), GREEDY,
                             admission=Admission(max_rows=4, max_num_batched_tokens=CHUNK))
    with open(f"{outdir}/rank{parallel.pp_rank}_{parallel.rank}.pkl", "wb") as f:
        ok = {i: o for i, o in results.items() if not isinstance(o, BaseException)}
        pickle.dump({"tokens": {i: o.generated_ids for i, o in ok.items()},
                     "errors": {i: str(e) for i, e in results.items() if i not in ok},
                     "kv": {i: o.prompt_kv for i, o in ok.items()}, "layers": engine.model.stage_layers,
                     "stats": stats}, f)


def _decode_went_through_compiled_regions() -> bool:
    """Whether this process ran an AR decode step through the compiled regions (they are made on first use)."""
    from components.engine.kernels import compiled_layers

    return "decode" in compiled_layers._regions


def dit_killing_stage1(parallel, **kwargs) -> dict:
    """The DiT step, with pipeline stage 1 killed (SIGKILL) in the middle of its first row group's
    denoising (its third (step, row) item)."""
    if parallel.pp_rank == 1:
        from components.runtime import pipeline_schedule

        plain, calls = pipeline_schedule._item, []

        def twice_then_die(*args, **kw):
            calls.append(1)
            if len(calls) == 3:
                os.kill(os.getpid(), signal.SIGKILL)
            return plain(*args, **kw)

        pipeline_schedule._item = twice_then_die
    from components.dit.run import run

    return run(parallel=parallel, **kwargs)


def pipeline_group(outdir: str, device: str, parallel) -> None:
    """Four tiny rows (prompts, two image sizes, T2I and IT2I; the last one without its K/V, so it
    recomputes its prefix and encodes its image) denoised together through the pipeline wavefront
    and, on the same engine, row by row; writes both latents per row."""
    import pickle

    import torch

    from components.engine import Engine
    from components.engine.ar import ARRequest, SamplingParams
    from components.engine.dit import DiTRequest
    from components.runtime.pipeline_schedule import denoise_rows
    from tests.test_engine_helpers import random_image

    import numpy as np

    torch.manual_seed(0)
    engine = Engine.load("tiny", device=device, tensor_parallel_size=parallel.world_size,
                         pipeline_parallel_size=parallel.pp_size, parallel=parallel)
    image = random_image(96, 64)
    asks = [ARRequest("a", "a red cat on a sofa", [image], seed=1), ARRequest("b", "a blue boat", [], seed=2),
            ARRequest("c", "a green hill at dawn", [], image_size=(64, 96), seed=3),
            ARRequest("d", "a yellow kite over a beach", [image], seed=4)]
    ars = engine.generate_ar(asks, SamplingParams(temperature=0.0, max_new_tokens=6))

    def requests():
        return [DiTRequest(ar, ask.images, ar.prompt_kv if ask.id != "d" else None,
                           "KV left out by the test" if ask.id == "d" else "", steps=3, guidance_scale=5.0)
                for ar, ask in zip(ars, asks)]

    vae = engine.model.vae
    encode, encodes = vae.encode, []
    vae.encode = lambda *a, **k: (encodes.append(1), encode(*a, **k))[1]  # this stage's VAE encodes
    together = denoise_rows(engine.dit, requests())
    vae.encode = encode
    alone = [engine.dit(r) for r in requests()]
    with open(f"{outdir}/rank{parallel.pp_rank}_{parallel.rank}.pkl", "wb") as f:
        pickle.dump({"together": [o.latents for o in together], "alone": [o.latents for o in alone],
                     "images": [None if o.image is None else np.asarray(o.image) for o in together],
                     "alone_images": [np.asarray(o.image) for o in alone],
                     "paths": [o.kv_path for o in together], "in_flight": together[0].timings["dit_rows_in_flight"],
                     "vae_encodes": len(encodes)},
                    f)


# ------------------------------------------------------------- data-parallel replicas (pipeline.local)
# run_job's STEP_TARGETS point here in tests; each wraps the real step in the replica's process.

def _step(name: str):
    from pipeline.local import STEP_TARGETS

    return STEP_TARGETS[name]  # the step function itself (not a 'module:function' string)


def _count_engine_loads() -> None:
    """Append this process's id to $ARDIT_TEST_LOAD_LOG at each Engine.load (patched once per process)."""
    from components.engine import Engine

    if getattr(Engine.load, "counted", False):
        return
    plain = Engine.load.__func__

    def load(cls, *args, **kwargs):
        with open(os.environ["ARDIT_TEST_LOAD_LOG"], "a") as f:
            f.write(f"{os.getpid()}\n")
        return plain(cls, *args, **kwargs)

    load.counted = True
    Engine.load = classmethod(load)


def ar_counting_loads(**kwargs):
    _count_engine_loads()
    return _step("ar")(**kwargs)


def dit_counting_loads(**kwargs):
    _count_engine_loads()
    return _step("dit")(**kwargs)


def dit_killed_once(**kwargs):
    """The DiT step; the first process to run it (across replicas: an O_EXCL flag file named by
    $ARDIT_TEST_KILL_FLAG) is killed (SIGKILL) once its first row is denoised."""
    try:
        os.close(os.open(os.environ["ARDIT_TEST_KILL_FLAG"], os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        first = True
    except FileExistsError:
        first = False
    if first:
        _kill_after_first_row()
    return _step("dit")(**kwargs)


def dit_always_killed(**kwargs):
    """The DiT step, with its process killed once its first row is denoised (every replica dies)."""
    _kill_after_first_row()
    return _step("dit")(**kwargs)


def _kill_after_first_row() -> None:
    from components.engine.dit import DiTGenerator

    plain = DiTGenerator.__call__

    def once_then_die(self, req):
        out = plain(self, req)
        os.kill(os.getpid(), signal.SIGKILL)
        return out

    DiTGenerator.__call__ = once_then_die


def report_progress(device: str, parallel, progress) -> dict:
    """A step that reports progress (as the AR / DiT steps do) and says where it ran."""
    task = progress.add_task("step shard 0", 3)
    progress.advance(task, 1)
    progress.advance(task, 2)
    progress.finish(task)
    progress.skip("step shard 1", "committed")
    return {"pid": os.getpid(), "parallel": parallel is not None, "device": device}



def stage_handoffs(outdir: str, device: str, parallel) -> None:
    """Stage 0 sends a bfloat16 [2, 3, 5] tensor; the last stage broadcasts a float32 [4] one while
    the other stages pass a placeholder of another dtype and shape: each stage pickles what it got."""
    import pickle

    import torch

    got = {}
    if parallel.pp_rank == 0:
        parallel.send_stage(torch.arange(30, dtype=torch.bfloat16).view(2, 3, 5), 1)
    else:
        got["received"] = parallel.recv_any_stage(0)
    mine = torch.tensor([1.5, 2.5, 3.5, 4.5]) if parallel.is_last_stage else torch.zeros(7, dtype=torch.bfloat16)
    got["broadcast"] = parallel.broadcast_from_last_stage(mine)
    with open(os.path.join(outdir, f"stage{parallel.pp_rank}.pkl"), "wb") as f:
        pickle.dump(got, f)


def ar_out_of_memory_on_stage0(parallel, **kwargs):
    """The AR step, where pipeline stage 0 (only) runs out of memory at its third scheduler step."""
    import torch

    from components.engine import ar_scheduler

    steps = [0]

    def oom(scheduler) -> None:
        steps[0] += 1
        if parallel.pp_rank == 0 and steps[0] == 3:
            raise torch.OutOfMemoryError("CUDA out of memory (injected on stage 0)")

    ar_scheduler.fault_hook = oom
    return _step("ar")(parallel=parallel, **kwargs)


def stage_round_trip(outdir: str, device: str, parallel) -> None:
    """1.0 from stage 0 through every stage (+1 each) and back to stage 0 on the way-back link, in the
    DiT wavefront's order (stage 0 sends on before it receives back): stage 0 writes what came back."""
    import json

    import torch

    value = torch.empty(1)
    if parallel.pp_rank == 0:
        sent = parallel.isend_stage(torch.ones(1), 1)
        parallel.recv_stage(value, parallel.pp_size - 1, back=True)
        sent.wait()
        with open(os.path.join(outdir, f"tp{parallel.rank}.json"), "w") as f:
            json.dump(value.item(), f)
        return
    parallel.recv_stage(value, parallel.pp_rank - 1)
    value += 1
    to = 0 if parallel.is_last_stage else parallel.pp_rank + 1
    parallel.isend_stage(value, to, back=parallel.is_last_stage).wait()


def decode_graph_agreement(failing_rank: int | None, device: str, parallel) -> dict:
    """`StaticDecoder._graphed` on tensor-parallel ranks whose capture is stubbed (no CUDA here):
    rank `failing_rank` fails its capture, the others capture. Returns, for rank 0, what it ran, and
    whether any rank kept a graph or still decodes with graphs (agreed over the ranks)."""
    import types

    import torch

    from components.engine import kernels
    from components.engine.kernels.decode import StaticDecoder

    torch.cuda.synchronize = lambda *a, **k: None  # what a failed capture syncs: no CUDA in this process
    modes = []

    def capture(fn, pool=None, mode="global"):
        modes.append(mode)
        if parallel.rank == failing_rank:
            raise RuntimeError("operation not permitted when stream is capturing")
        return types.SimpleNamespace(replay=lambda: None), torch.zeros(1)  # the graph's output buffer

    decoder = types.SimpleNamespace(use_graphs=True, graphs={}, model=types.SimpleNamespace(parallel=parallel),
                                    stages=None, pool=None, capture=capture, rows=4, graph_error=None)
    out = StaticDecoder._graphed(decoder, (0, 4, 1024), lambda: torch.ones(1))  # eager: ones
    kept_anywhere, graphs_anywhere = parallel.agree_max([len(decoder.graphs), int(decoder.use_graphs)])
    return {"out": out.tolist(), "modes": modes, "kept_anywhere": kept_anywhere,
            "graphs_anywhere": graphs_anywhere, "fallbacks": kernels.fallbacks()}
