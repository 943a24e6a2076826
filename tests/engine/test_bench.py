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
