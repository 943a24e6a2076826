"""The rollout benchmark's workloads (``asyncrl bench rollout`` and the bench/ scripts that time a and c)."""
from asyncrl.engine.bench import nano_workload, workload_a, workload_c


def test_workload_a_is_random_prompts_at_temperature_one():
    prompts, params = workload_a(vocab=500, batch=3, prompt=7, response=5)
    assert [len(p) for p in prompts] == [7, 7, 7] and all(0 < t < 500 for p in prompts for t in p)
    assert (params.temperature, params.max_tokens, params.ignore_eos) == (1.0, 5, True)
    assert workload_a(500, 3, 7, 5)[0] == prompts  # seeded: every script times the same prompts


def test_workload_c_is_nano_vllms_requests_folded_into_the_vocabulary():
    prompts, params = workload_c(vocab=300, seqs=6, max_in=150, max_out=120)
    raw, outs = nano_workload(6, 150, 120)
    assert prompts == [[t % 300 for t in p] for p in raw] and all(100 <= len(p) <= 150 for p in prompts)
    assert [p.max_tokens for p in params] == outs and all(100 <= m <= 120 for m in outs)
    assert all(p.temperature == 0.6 and p.ignore_eos for p in params)


def test_interleaved_ab_runs_each_engine_under_its_own_variant():
    """Every engine is built and timed with its variant applied; repeats interleave the variants."""
    import torch

    from asyncrl.engine import LLM
    from asyncrl.engine.bench import build_random_hf, interleaved_ab

    hf = build_random_hf("tiny", torch.float32, "cpu", 256)
    state = {"flag": None}
    seen = []  # (engine's variant at build, flag at generate)

    class Recording(LLM):
        def generate(self, prompts, params):
            seen.append((self.variant, state["flag"]))
            return super().generate(prompts, params)

    def build():
        llm = Recording(hf, dtype=torch.float32, device="cpu")
        llm.variant = state["flag"]
        return llm

    variants = {name: (lambda n=name: state.__setitem__("flag", n)) for name in ("off", "on")}
    loads = {"a": workload_a(512, batch=2, prompt=4, response=3), "c": workload_a(512, batch=1, prompt=5, response=2)}
    out = interleaved_ab(build, variants, loads, repeats=2, device="cpu")
    assert all(built == active for built, active in seen)
    # 2 untimed runs per engine, then per repeat per workload: off, on
    assert [v for v, _ in seen] == ["off"] * 2 + ["on"] * 2 + ["off", "on"] * 4
    assert set(out) == {"a", "c"} and len(out["a"]["tokens_per_s"]["on"]) == 2
    assert set(out["c"]["over_baseline"]) == {"on"} and out["c"]["median"]["off"] > 0
