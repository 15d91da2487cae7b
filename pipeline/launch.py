"""``python -m pipeline.launch [OPTIONS] -- python -m components.STEP ARGS...``: how every step container starts.

Workflow engines fill a fixed argv from run parameters, so the launcher turns it into the step's
real command line, then runs it:

1. expands ``$(VAR)`` from the environment where Kubernetes did not (KFP substitutes parameter
   values after Kubernetes has expanded the container's args), as Kubernetes does: unknown
   variables stay as written, ``$$`` escapes;
2. drops options whose value is empty (``--quantization ""``): an empty run parameter means "the
   step's default" (the model's generation config, no quantization);
3. with ``--weights-pvc``, checks the step's ``--model`` against the weights PVC (a PVC and the
   tiny preset never go together), exiting 2 with one line when they do not match;
4. with ``--retries N`` (KFP, which cannot skip exit codes), runs the step up to N more times with
   exponential backoff, except on the ``--no-retry-exit-codes``; each attempt is killed after
   ``--attempt-timeout`` seconds. Without retries it replaces itself with the step (Argo retries pods);
5. with ``--not-after T`` (a scheduled KFP run's whole-run deadline, Unix time; empty: none),
   starts no attempt after T and stops a running one at T (exit 124), retries or not.

Exit status: the step's, or 2 for a launcher usage error, or 128 + N when the step died of signal N.
Standard library only, plus pipeline.cluster for the model/PVC rule.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand(value: str, env: Mapping[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: defined variables are replaced, others kept, $$ becomes $."""
    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        return env[name] if name in env else m.group(0)

    return _VAR.sub(sub, value)


def drop_empty_options(argv: Sequence[str]) -> list[str]:
    """``--flag ""`` pairs removed; everything else kept in order."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i].startswith("--") and i + 1 < len(argv) and argv[i + 1] == "":
            i += 2
            continue
        out.append(argv[i])
        i += 1
    return out


def option_value(argv: Sequence[str], flag: str) -> str | None:
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def step_argv(argv: Sequence[str], env: Mapping[str, str] | None = None) -> list[str]:
    """What the step actually receives: variables expanded, then empty options dropped."""
    env = os.environ if env is None else env
    return drop_empty_options([expand(a, env) for a in argv])


def _parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    if "--" not in argv:
        raise SystemExit("error: pipeline.launch: no step command (expected: OPTIONS -- python -m MODULE ARGS)")
    split = list(argv).index("--")
    p = argparse.ArgumentParser(prog="python -m pipeline.launch", description=__doc__.split("\n\n")[0])
    p.add_argument("--weights-pvc", default=None, help="the run's weights_pvc (empty: none); checks the step's --model")
    p.add_argument("--retries", type=int, default=0, help="re-run a failed step up to this many times")
    p.add_argument("--backoff", type=float, default=30.0, help="seconds before the first retry")
    p.add_argument("--backoff-factor", type=float, default=2.0)
    p.add_argument("--backoff-max", type=float, default=600.0)
    p.add_argument("--no-retry-exit-codes", default="2", help="comma-separated exit codes never retried")
    p.add_argument("--attempt-timeout", type=float, default=0, help="seconds per attempt (0: none)")
    p.add_argument("--not-after", default="", help="Unix time after which no attempt runs (empty: none)")
    opts = p.parse_args(argv[:split])
    command = list(argv[split + 1:])
    if not command:
        raise SystemExit("error: pipeline.launch: empty step command after --")
    return opts, command


_forwarded: subprocess.Popen | None = None
_stopping = False


def _forward(signum: int, _frame: object) -> None:
    # Kubernetes stops a pod with SIGTERM to PID 1 (us): pass it on so the step can stop cleanly,
    # and start no further attempt.
    global _stopping
    _stopping = True
    if _forwarded is not None and _forwarded.poll() is None:
        _forwarded.send_signal(signum)


def _attempt(command: list[str], timeout: float) -> int:
    global _forwarded
    _forwarded = subprocess.Popen(command)
    try:
        rc = _forwarded.wait(timeout=timeout or None)
    except subprocess.TimeoutExpired:
        print(f"pipeline.launch: attempt exceeded {timeout:.0f} s; stopping it", file=sys.stderr, flush=True)
        _forwarded.terminate()
        try:
            _forwarded.wait(timeout=30)
        except subprocess.TimeoutExpired:
            _forwarded.kill()
            _forwarded.wait()
        return 124
    return 128 - rc if rc < 0 else rc


def main(argv: Sequence[str] | None = None) -> int:
    opts, command = _parse(sys.argv[1:] if argv is None else argv)
    command = step_argv(command)
    if opts.weights_pvc is not None:
        from pipeline.cluster import check_model_and_weights

        model = option_value(command, "--model")
        if model is not None:
            try:
                check_model_and_weights(model, opts.weights_pvc)
            except ValueError as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
    never = {int(c) for c in opts.no_retry_exit_codes.split(",") if c.strip()}
    try:
        not_after = float(opts.not_after) if opts.not_after.strip() else None
    except ValueError:
        print(f"error: pipeline.launch: --not-after {opts.not_after!r} is not a Unix time", file=sys.stderr)
        return 2
    if opts.retries <= 0 and not opts.attempt_timeout and not_after is None:
        sys.stdout.flush()
        os.execvp(command[0], command)  # no return
    signal.signal(signal.SIGTERM, _forward)
    signal.signal(signal.SIGINT, _forward)
    delay = opts.backoff
    for attempt in range(opts.retries + 1):
        timeout = opts.attempt_timeout
        if not_after is not None:
            left = not_after - time.time()
            if left <= 0:
                print(f"error: pipeline.launch: the run's deadline ({time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(not_after))}) "
                      "has passed: not starting the step", file=sys.stderr, flush=True)
                return 124
            timeout = min(timeout, left) if timeout else left
        rc = _attempt(command, timeout)
        if rc == 0 or rc in never or attempt == opts.retries or _stopping:
            return rc
        if not_after is not None and time.time() + delay >= not_after:
            print(f"pipeline.launch: attempt {attempt + 1} exited {rc}; the run's deadline comes before the next "
                  "attempt", file=sys.stderr, flush=True)
            return rc
        print(f"pipeline.launch: attempt {attempt + 1} exited {rc}; retrying in {delay:.0f} s "
              f"({opts.retries - attempt} left)", file=sys.stderr, flush=True)
        time.sleep(delay)
        delay = min(delay * opts.backoff_factor, opts.backoff_max)
    return rc


if __name__ == "__main__":
    sys.exit(main())
