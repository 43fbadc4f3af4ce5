"""Bounded load test of ``idml serve`` on loopback: throughput and p50/p99 latency.

Builds a small trained run (digits, small CNN) and an index of ``--gallery`` random PNG images,
starts the service on 127.0.0.1 (an ephemeral port, in this process's background thread), then
sends exactly ``--requests`` ``POST /search`` requests from ``--concurrency`` client threads
(httpx), once with image uploads (multipart; embedding + search) and once with embedding queries
(search only). Every answer must be a 200 with ``k`` neighbours; it stops by itself.

Example (the recorded run): ``python benchmarks/bench_serve.py --requests 400 --concurrency 8``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gallery", type=int, default=2000, help="images in the index")
    p.add_argument("--requests", type=int, default=400, help="requests per query kind")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("-k", type=int, default=10)
    args = p.parse_args()

    import httpx
    from PIL import Image

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from idml.app.cli import main as cli
    from idml.app.inference import Encoder
    from idml.app.retrieval import Index
    from idml.app.retrieval.server import BackgroundServer, create_app
    from tiny_run import IDML, train_tiny, write_images

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        train_tiny(root, IDML)
        write_images(root / "gallery", classes=20, per_class=args.gallery // 20, shape=(16, 16))
        rng = np.random.default_rng(1)
        index_dir = root / "index"
        run = str(root / "run")
        build = ["index", str(root / "gallery"), "--out", str(index_dir), "--checkpoint", run]
        assert cli([*build, "--no-progress"]) == 0
        index = Index.load(index_dir)
        app = create_app(index, Encoder.from_run(root / "run"), max_k=args.k)
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(buf, "PNG")
        png = buf.getvalue()
        assert index.embeddings is not None  # an exact index (built without --no-vectors)
        emb = index.embeddings[0].tolist()
        kinds = {
            "image (multipart)": lambda c: c.post(
                "/search", files={"image": ("q.png", png, "image/png")}, data={"k": str(args.k)}
            ),
            "embedding (JSON)": lambda c: c.post("/search", json={"embedding": emb, "k": args.k}),
        }
        report = {
            "gallery": args.gallery,
            "dim": index.dim,
            "requests": args.requests,
            "concurrency": args.concurrency,
            "k": args.k,
        }
        print(json.dumps(report))
        with BackgroundServer(app) as server:
            for name, send in kinds.items():
                clients = [
                    httpx.Client(base_url=server.url, timeout=60) for _ in range(args.concurrency)
                ]

                def one(i: int, send=send, clients=clients) -> float:
                    t0 = time.perf_counter()
                    r = send(clients[i % len(clients)])
                    elapsed = time.perf_counter() - t0
                    assert r.status_code == 200, r.text
                    assert len(r.json()["results"][0]["neighbors"]) == args.k
                    return elapsed

                for i in range(args.concurrency):  # warm-up: one request per connection
                    one(i)
                start = time.perf_counter()
                with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
                    latencies = sorted(pool.map(one, range(args.requests)))
                wall = time.perf_counter() - start
                for c in clients:
                    c.close()
                row = {
                    "query": name,
                    "throughput_rps": args.requests / wall,
                    "p50_ms": 1000 * statistics.median(latencies),
                    "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
                    "wall_s": wall,
                }
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
