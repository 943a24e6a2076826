"""The cost of a weight push to a fleet of replicas, by launcher: local processes reading shared
CPU tensors (``replicas.py``, ``runtime.weight_transport=shared``) vs Ray actors fed through the
object store (``ray_replicas.py``), on the CPU, same model, same number of replicas.

A push = ``Fleet.update_weights``: write the trainer's tensors once (a copy into the shared
tensors / a CPU copy put in the object store), then every replica loads them into its engine
and acknowledges. Prints one JSON line per launcher: the median push seconds over ``--pushes``
and the model's bytes / that time.

    python bench/ray_fleet_push.py --hidden 512 --layers 8 --engines 2 --pushes 5   # ~1-2 min, 2 cores
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM


def model_of(args) -> torch.nn.Module:
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=max(args.hidden // 64, 1), num_key_value_heads=max(args.hidden // 128, 1),
                         head_dim=64, intermediate_size=3 * args.hidden, tie_word_embeddings=True)
    return Qwen3ForCausalLM(config).eval()


def time_pushes(fleet, model, pushes: int) -> list[float]:
    seconds = []
    for version in range(1, pushes + 1):
        with torch.no_grad():
            for p in model.parameters():  # new weights each push, as after an optimizer step
                p.add_(1e-4)
        start = time.perf_counter()
        fleet.update_weights(model.named_parameters(), version)
        seconds.append(time.perf_counter() - start)
        assert fleet.replica_versions() == dict.fromkeys(range(len(fleet.replicas)), version)
    return seconds


def start(launcher: str, model, engines: int, log_dir: str):
    options = {"max_num_seqs": 4, "num_kv_blocks": 64}
    if launcher == "process":
        from asyncrl.runtime.executors.replicas import start_fleet

        return start_fleet(model, None, "engine", engines=engines, tensor_parallel_size=1, rollout_device="cpu",
                           engine_options=options, log_dir=log_dir)
    from asyncrl.runtime.executors.ray_cluster import init_ray
    from asyncrl.runtime.executors.ray_replicas import start_ray_fleet

    init_ray(num_cpus=engines + 1)
    return start_ray_fleet(model, None, "engine", engines=engines, tensor_parallel_size=1, on_gpu=False,
                           engine_options=options, log_dir=log_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--pushes", type=int, default=5)
    parser.add_argument("--launchers", default="process,ray")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = model_of(args)
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    for launcher in args.launchers.split(","):
        t0 = time.perf_counter()
        fleet = start(launcher, model, args.engines, tempfile.mkdtemp(prefix=f"fleet-{launcher}-"))
        started = time.perf_counter() - t0
        try:
            seconds = time_pushes(fleet, model, args.pushes)
        finally:
            fleet.close()
        median = statistics.median(seconds)
        print(json.dumps({"launcher": launcher, "engines": args.engines, "model_mb": round(size / 2**20, 1),
                          "start_s": round(started, 2), "push_s_median": round(median, 4),
                          "push_s_all": [round(s, 4) for s in seconds],
                          "gb_per_s": round(size / median / 1e9, 3)}), flush=True)


if __name__ == "__main__":
    main()
