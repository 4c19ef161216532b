#!/usr/bin/env python3
"""Grammar-constrained decoding speed, with the mask computed ahead (on a worker thread, during the model's
step) and inline (`LUCEBOX_MASK_AHEAD=0`, the loop as it was), on an idle CPU and on one kept busy.

It serves the model in this process and sends `tool_choice: "required"` chat requests through HTTP, as a
client would; the speed is the server's own `usage.timings.predicted_per_second` (decode tokens per second),
the median over `--repeats` requests with the same seed. `--busy N` runs N processes spinning on the CPU
meanwhile (default: one per core). The table goes to stdout; `--json` prints it as one JSON object.

    python scripts/constrained_decode_bench.py                      # the default tiny model
    python scripts/constrained_decode_bench.py -m model.gguf -n 128 --busy 16
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import time

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city", "unit", "note"],
    "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["c", "f"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 14},
                   "note": {"type": "string", "maxLength": 400}}}}}]  # fmt: skip


def _spin(stop) -> None:
    while not stop.is_set():
        sum(i * i for i in range(10_000))


def _speeds(url: str, args: argparse.Namespace) -> list[float]:
    import httpx

    speeds = []
    for _ in range(args.repeats):
        body = {"model": "m", "messages": [{"role": "user", "content": "Weather in Paris, with a long note?"}],
                "tools": TOOLS, "tool_choice": "required", "max_tokens": args.n_predict, "temperature": 1.0,
                "seed": 7}
        response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
        response.raise_for_status()
        speeds.append(response.json()["usage"]["timings"]["predicted_per_second"])
    return speeds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-m", "--model", help="GGUF file (default: the embedded default model)")
    parser.add_argument("-n", "--n-predict", type=int, default=64, help="max_tokens of each request")
    parser.add_argument("-r", "--repeats", type=int, default=3)
    parser.add_argument("--busy", type=int, default=os.cpu_count() or 1, help="spinning processes in the busy rows")
    parser.add_argument("--backend", help="kernel backend (default: the available one with the highest priority)")
    parser.add_argument("--threads", type=int, default=1, help="torch's CPU threads (one: small ops fastest)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    import torch

    from lucebox_core.server import ModelService, ServeConfig, create_app
    from lucebox_core.server.testing import ServerThread

    torch.set_num_threads(args.threads)
    service = ModelService(ServeConfig(model=args.model, backend=args.backend, ctx_size=4096))
    service.load()
    if service.status != "ok":
        print(f"error: {service.error}", file=sys.stderr)
        return 2
    rows = []
    before = os.environ.get("LUCEBOX_MASK_AHEAD")
    with ServerThread(create_app(service.config, service)) as url:
        _speeds(url, argparse.Namespace(**{**vars(args), "repeats": 1}))  # warm up (grammar tables, graphs)
        for busy in (0, args.busy):
            stop = multiprocessing.Event()
            spinners = [multiprocessing.Process(target=_spin, args=(stop,), daemon=True) for _ in range(busy)]
            for spinner in spinners:
                spinner.start()
            time.sleep(0.5 if busy else 0)
            try:
                for ahead in ("1", "0"):
                    os.environ["LUCEBOX_MASK_AHEAD"] = ahead
                    speeds = _speeds(url, args)
                    rows.append({"busy_processes": busy, "mask": "ahead" if ahead == "1" else "inline",
                                 "decode_tokens_per_s": round(statistics.median(speeds), 2),
                                 "all": [round(s, 2) for s in speeds]})
            finally:
                stop.set()
                for spinner in spinners:
                    spinner.join()
    service.close()
    if before is None:
        os.environ.pop("LUCEBOX_MASK_AHEAD", None)
    else:
        os.environ["LUCEBOX_MASK_AHEAD"] = before
    if args.json:
        print(json.dumps({"model": service.model_name, "backend": service.loaded.backend_name, "rows": rows}))
    else:
        print(f"model {service.model_name}, backend {service.loaded.backend_name}, max_tokens {args.n_predict}")
        print("| busy processes | mask | decode tok/s (median) | each |")
        print("| --- | --- | --- | --- |")
        for row in rows:
            print(f"| {row['busy_processes']} | {row['mask']} | {row['decode_tokens_per_s']} | {row['all']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
