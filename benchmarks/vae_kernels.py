"""The VAE's GroupNorm on one GPU: compiled norm (+SiLU) ("fast") against nn.GroupNorm ("plain"), at
full size with random weights (float32 weights under float16 autocast, as the engine runs it);
about a minute on an H200, most of it compiling.

    python3 benchmarks/vae_kernels.py --out $OUT/vae_kernels.json
    python3 benchmarks/vae_kernels.py --device cpu --tiny --size 64 --out /tmp/vae_kernels.json  # CPU smoke test

"plain" is the kernel setting compile=off (as in ARDIT_KERNELS=plain: every norm is nn.GroupNorm),
"fast" the default (compile=auto). Per mode: `encode` of a 1 x 3 x size x size image
(sample_posterior=False) and `decode` of the plain encode's latents: median ms (CUDA events, after a
warm-up; the first call, which compiles, is timed apart), peak memory of one call; fast vs plain
max abs / relative difference of latents and pixels. Also one norm + SiLU + float16 cast at the
encoder's first activation (128 x 4 frames x size^2, float16) and the decoder's last (the same in
float32). On the CPU both modes run nn.GroupNorm (the compiled path is CUDA only): that run checks
the plumbing. `--cudnn-benchmark` lets cuDNN time its convolution algorithms per shape first.
Prints a table; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from components.engine import kernels  # noqa: E402
from components.engine.config import VAEConfig, tiny_config  # noqa: E402
from components.engine.kernels.compiled import compile_failures  # noqa: E402
from components.engine.vae import AutoencoderKLConv3D, GroupNorm, build_vae  # noqa: E402

MODES = {"plain": "compile=off", "fast": "compile=auto"}
T0 = time.time()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def median_ms(fn, device: str, warmup: int, repeat: int) -> float:
    """Median milliseconds of fn(): CUDA events on the GPU, the wall clock on the CPU."""
    if device == "cuda":
        from benchmarks.engine_layers import cuda_time

        return cuda_time(fn, warmup=warmup, repeat=repeat)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def peak_gb(fn, device: str) -> float | None:
    """Peak memory allocated during one fn() call (what was held before included)."""
    if device != "cuda":
        return None
    sync(device)
    torch.cuda.reset_peak_memory_stats()
    fn()
    sync(device)
    return torch.cuda.max_memory_allocated() / 1e9


def first_call_s(fn, device: str) -> float:
    sync(device)
    t = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t


def diff(a: torch.Tensor, b: torch.Tensor) -> dict:
    """Max abs and relative (norm-wise) difference of a against the reference b."""
    a, b = a.float(), b.float()
    return {"max_abs": (a - b).abs().max().item(), "rel": ((a - b).norm() / b.norm()).item(),
            "finite": bool(torch.isfinite(a).all())}


def time_vae(vae: AutoencoderKLConv3D, x: torch.Tensor, z: torch.Tensor, args) -> dict:
    """Encode x and decode z in the current kernel setting; outputs kept for the comparison."""
    dev, reps = args.device, dict(warmup=args.warmup, repeat=args.repeat)
    out: dict = {}
    for name, fn in (("encode", lambda: vae.encode(x, sample_posterior=False)), ("decode", lambda: vae.decode(z))):
        out[f"{name}_first_call_s"] = first_call_s(fn, dev)
        out[f"{name}_ms"] = median_ms(fn, dev, **reps)
        out[f"{name}_peak_gb"] = peak_gb(fn, dev)
        out[name] = fn()
    return out


def time_norms(channels: int, size: int, frames: int, args) -> dict:
    """norm1 + SiLU as the next conv reads it (float16 under autocast) at the widest activations:
    the encoder's first (float16 residual stream) and the decoder's last (float32 stream)."""
    dev = args.device
    norm = GroupNorm(32, channels, eps=1e-6).to(dev)
    out: dict = {}
    autocast = torch.autocast("cuda", dtype=torch.float16) if dev == "cuda" else torch.autocast("cpu", enabled=False)
    for stream in (torch.float16, torch.float32):
        x = torch.randn(1, channels, frames, size, size, device=dev, dtype=stream)
        row = {}
        with torch.no_grad(), autocast:  # the compiled path is for inference only
            for mode, spec in MODES.items():
                kernels.configure(spec)
                conv_dtype = torch.float16 if dev == "cuda" else x.dtype
                fn = lambda: norm.conv_input(x).to(conv_dtype)  # noqa: E731 - the conv's cast, in both modes
                fn()
                row[f"{mode}_ms"] = median_ms(fn, dev, warmup=args.warmup, repeat=args.repeat)
                row[mode] = fn()
        row["fast_vs_plain"] = diff(row.pop("fast"), row.pop("plain"))
        out[f"{str(stream).removeprefix('torch.')}_in"] = row
    return out


def table(res: dict) -> str:
    lines = [f"VAE {res['config']} {res['size']}x{res['size']} on {res['device']}",
             f"{'':22s} {'plain ms':>10s} {'fast ms':>10s} {'x':>6s} {'plain GB':>9s} {'fast GB':>9s}  fast vs plain"]
    p, f = res.get("plain", {}), res.get("fast", {})
    for name in ("encode", "decode"):
        if f"{name}_ms" not in p or f"{name}_ms" not in f:
            continue
        ms = [m[f"{name}_ms"] for m in (p, f)]
        gb = [f"{m[f'{name}_peak_gb']:9.2f}" if m.get(f"{name}_peak_gb") is not None else f"{'-':>9s}" for m in (p, f)]
        d = res["fast_vs_plain"][name]
        lines.append(f"{name:22s} {ms[0]:10.1f} {ms[1]:10.1f} {ms[0] / ms[1]:6.2f} {gb[0]} {gb[1]}  "
                     f"max abs {d['max_abs']:.2e}, rel {d['rel']:.2e}")
    for key, row in res.get("norm", {}).items():
        if isinstance(row, dict) and "plain_ms" in row:
            d = row["fast_vs_plain"]
            lines.append(f"{'norm+silu ' + key:22s} {row['plain_ms']:10.3f} {row['fast_ms']:10.3f} "
                         f"{row['plain_ms'] / row['fast_ms']:6.2f} {'':9s} {'':9s}  max abs {d['max_abs']:.2e}")
    lines.append(f"first fast call (compiles): encode {f.get('encode_first_call_s', float('nan')):.1f} s, "
                 f"decode {f.get('decode_first_call_s', float('nan')):.1f} s; graphs compiled {res.get('graphs')}; "
                 f"compile failures {res.get('compile_failures') or 'none'}; fallbacks {res.get('kernel_fallbacks')}")
    lines.append(f"wall {res.get('wall_s', time.time() - T0):.0f} s")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="the tiny test VAE instead of the full-size one")
    p.add_argument("--size", type=int, default=1024, help="image side (a multiple of 16)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--cudnn-benchmark", action="store_true",
                   help="let cuDNN time its convolution algorithms per shape (torch.backends.cudnn.benchmark)")
    p.add_argument("--out", default="")
    args = p.parse_args()
    torch.backends.cudnn.benchmark = args.cudnn_benchmark

    cfg = tiny_config().vae if args.tiny else VAEConfig()
    res: dict = {"config": "tiny" if args.tiny else "full", "size": args.size, "torch": torch.__version__,
                 "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                 "date": time.strftime("%Y-%m-%d"), "cudnn_benchmark": args.cudnn_benchmark}
    torch.manual_seed(0)
    vae = build_vae(cfg).to(args.device).eval()  # float32 weights, float16 autocast on CUDA (engine defaults)
    res["weights_gb"] = sum(t.numel() * t.element_size() for t in vae.parameters()) / 1e9
    x = torch.rand(1, 3, args.size, args.size, device=args.device) * 2 - 1
    previous = kernels.configure()
    try:
        outputs = {}
        for mode, spec in MODES.items():
            kernels.configure(spec)
            z = outputs["plain"]["encode"] if mode == "fast" else vae.encode(x, sample_posterior=False)
            outputs[mode] = time_vae(vae, x, z, args)
            res[mode] = {k: v for k, v in outputs[mode].items() if not isinstance(v, torch.Tensor)}
            print(f"[{time.time() - T0:6.1f}s] {mode}: {json.dumps(res[mode])}", flush=True)
        res["fast_vs_plain"] = {name: diff(outputs["fast"][name], outputs["plain"][name])
                                for name in ("encode", "decode")}
        del outputs
        side = args.size  # the encoder's first and the decoder's last activation
        res["norm"] = time_norms(cfg.block_out_channels[0], side, cfg.ffactor_temporal, args)
    finally:
        kernels.configure(previous)
    res["graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    res["compile_failures"] = dict(compile_failures)
    res["kernel_fallbacks"] = kernels.fallbacks()
    res["wall_s"] = time.time() - T0
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1, default=str)
    print("\n" + table(res))


if __name__ == "__main__":
    main()
