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
# Bytecode, as our images have it (pip compiles at install): on the lent machine every process compiled
# ~1 000 modules from source (4.8 s of the checks' 14.4 s on 2 x H100, 2026-11-26; the CLI, each rank
# and the memory probe each pay it), so its venv's bytecode is absent or unused. Keep it under /tmp,
# compiled once a machine here, outside any benchmark's clock (not yet run on the lent machine).
export PYTHONPYCACHEPREFIX=/tmp/ardit-pycache
if [ ! -f "$PYTHONPYCACHEPREFIX/.compiled" ]; then
  python3 -m compileall -q -j 0 "$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" "$site" \
    components pipeline >/dev/null 2>&1
  touch "$PYTHONPYCACHEPREFIX/.compiled" && echo "gpu_env: bytecode compiled into $PYTHONPYCACHEPREFIX"
fi
python3 -c "import diffusers, pyarrow, typer, rich, torch; print('gpu_env: torch', torch.__version__, 'gpus', torch.cuda.device_count())"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
