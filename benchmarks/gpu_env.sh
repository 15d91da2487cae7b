#!/usr/bin/env bash
# Source on the lent GPU machine (device tool) before running ardit there:
#   . benchmarks/gpu_env.sh
# It has torch but not diffusers (and maybe not typer/rich): install the carried wheels (.whl/, .whl2/)
# of the modules that do not import, into /tmp/site, and put it and the repo on PYTHONPATH.
site=/tmp/site
mkdir -p "$site"
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
for spec in diffusers:diffusers typer:typer rich:rich shellingham:shellingham click:click tqdm:tqdm yaml:pyyaml \
            markdown_it:markdown_it_py mdurl:mdurl pygments:pygments annotated_doc:annotated_doc; do
  module=${spec%%:*}; wheel=${spec##*:}
  python3 -c "import $module" 2>/dev/null && continue
  for w in .whl/${wheel}-*.whl .whl2/${wheel}-*.whl; do
    [ -f "$w" ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$w" \
      && echo "gpu_env: installed $(basename "$w")"
  done
done
python3 -c "import diffusers, pyarrow, typer, rich, torch; print('gpu_env: torch', torch.__version__, 'gpus', torch.cuda.device_count())"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
