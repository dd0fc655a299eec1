"""Per-step cost of the hooks: reporting every step with all guards on, vs the same loop without them.

The model is examples/train.py's transformer LM. The baseline is the loop a user writes anyway:
next batch, forward, backward, clip the gradient norm at 1.0, optimizer and scheduler step. The
hooked loop is the same, with ``Hooks`` doing the clipping (one norm computation, shared with
the guard), timing the phases, checking for spikes and non-finite values, and sending a step
report every step to a control plane (a separate process, as a real one would be). No
checkpoints: their cost is measured by ``bench.ckpt_blocking``.

Short blocks of steps alternate between the two loops; per run, the median step time of all the
hooked blocks is compared with that of the plain blocks. Metric: median over runs of
hooked / plain - 1 (target < 0.01).

    python -m bench.hook_overhead [--quick]
"""

from __future__ import annotations

import json
import multiprocessing
import socket
import tempfile
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
import torch.nn.functional as F  # noqa: N812
from torch.utils.data import DataLoader

from agents.hooks import Environment, Hooks
from bench._common import arguments, emit, median, spread
from examples.train import SyntheticTokens, TinyLM
from tests.ports import free_port

SHAPE = {"vocab": 256, "dim": 96, "layers": 2, "heads": 4, "seq_len": 64, "dropout": 0.0}
BATCH = 8
ALTERNATIONS = 8  # plain/hooked block pairs per run


def sink(port: int) -> None:
    """A control plane that accepts everything (run in its own process)."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def _answer(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self) -> None:  # noqa: N802
            batch = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            self._answer(202, {"accepted": len(batch.get("reports", [])), "duplicates": 0,
                               "control": {"generation": 0}})

        def do_GET(self) -> None:  # noqa: N802
            self._answer(200, {"generation": 0})

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


def lm_loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, SHAPE["vocab"]), tokens[:, 1:].reshape(-1))


def new_model() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(0)
    model = TinyLM(**SHAPE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)


def plain_block(steps: int) -> Callable[[], list[float]]:
    model, optimizer, scheduler = new_model()
    loader = iter(DataLoader(SyntheticTokens(100_000, SHAPE["seq_len"], SHAPE["vocab"], 0), batch_size=BATCH,
                             shuffle=True, generator=torch.Generator().manual_seed(0)))

    def run() -> list[float]:
        times = []
        for _ in range(steps):
            started = time.perf_counter()
            batch = next(loader)
            lm_loss(model, batch["tokens"]).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - started)
        return times

    return run


def hooked_block(steps: int, url: str, spool_dir: str) -> tuple[Hooks, Callable[[], list[float]]]:
    model, optimizer, scheduler = new_model()
    nw = Hooks(model, optimizer, scheduler=scheduler, dataset=SyntheticTokens(100_000, SHAPE["seq_len"],
               SHAPE["vocab"], 0), batch_size=BATCH, max_grad_norm=1.0, tokens_per_sample=SHAPE["seq_len"],
               env=Environment(url=url, job="bench", spool_dir=spool_dir))

    def run() -> list[float]:
        times = []
        started = time.perf_counter()
        for batch in nw.batches(max_steps=nw.step_count + steps):
            loss = lm_loss(model, batch["tokens"])
            loss.backward()
            nw.step(loss)
            now = time.perf_counter()
            times.append(now - started)
            started = now
        return times

    return nw, run


def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    steps = 10 if args.quick else 20
    port = free_port()
    server = multiprocessing.get_context("spawn").Process(target=sink, args=(port,), daemon=True)
    server.start()
    _wait_for_listener(port)
    try:
        with tempfile.TemporaryDirectory(prefix="nightwatch-bench-") as spool_dir:
            plain = plain_block(steps)
            nw, hooked = hooked_block(steps, f"http://127.0.0.1:{port}", spool_dir)
            for _ in range(3):  # warm-up: allocator, spool file, first reports and control poll
                plain(), hooked()
            plain_ms, hooked_ms, ratios = [], [], []
            for run in range(1, args.runs + 1):
                # Short alternating blocks, pooled per run, so drift in the machine's load (other
                # jobs share these cores) hits both loops alike.
                plain_times, hooked_times = [], []
                for _ in range(ALTERNATIONS):
                    plain_times += plain()
                    hooked_times += hooked()
                p, h = median(plain_times), median(hooked_times)
                plain_ms.append(p * 1000)
                hooked_ms.append(h * 1000)
                ratios.append(h / p - 1)
                print(f"run {run}: plain {p * 1000:.2f} ms/step, hooked {h * 1000:.2f} ms/step, "
                      f"overhead {ratios[-1]:+.2%}", flush=True)
            nw.close()
    finally:
        server.terminate()
        server.join(5)
    emit("hook_overhead", metric="overhead_per_step", value=round(median(ratios), 4), target=0.01,
         better="lower", unit="ratio", runs=args.runs, spread=[round(v, 4) for v in spread(ratios)],
         details={"steps_per_block": steps, "blocks_per_run": ALTERNATIONS,
                  "plain_ms_per_step": plain_ms, "hooked_ms_per_step": hooked_ms,
                  "model": SHAPE, "batch": BATCH,
                  "note": "both loops clip gradients at 1.0; the hooked loop reports every step over HTTP"})


def _wait_for_listener(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("the control-plane sink did not start")


if __name__ == "__main__":
    main()
