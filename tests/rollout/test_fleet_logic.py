"""The fleet's logic with in-process replicas (no processes): whole groups placed by outstanding
tokens, the same outputs as one engine, a dead replica's groups generated on the others, the
version raised only when every live replica acknowledged it, sessions kept on their replica."""
import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from asyncrl.rollout.engine_backend import EngineBackend
from asyncrl.rollout.fleet import Fleet, FleetError
from asyncrl.runtime.weight_sync import ProbeResult
from asyncrl.types import Completion, RequestOutput, SamplingParams

PARAMS = SamplingParams(n=4, temperature=1.0, max_tokens=5, seed=3, logprobs=True, ignore_eos=True)


class FakeReplica:
    """Answers each prompt with its own ids; records calls; can die."""

    def __init__(self, name, backend=None):
        self.name, self.backend, self.version = name, backend, 0
        self.calls, self.alive, self.die_on_generate, self.pending = [], True, False, []

    def generate(self, prompts, params):
        if self.die_on_generate:
            self.alive = False
            raise RuntimeError(f"{self.name} died")
        self.calls.append([list(p) for p in prompts])
        if self.backend is not None:
            return self.backend.generate(prompts, params)
        return [RequestOutput(list(p), None, [Completion(list(p), "", None, "length", [self.version] * len(p))
                                              for _ in range(params.n)]) for p in prompts]

    def notify_update(self, version):
        if not self.alive:
            raise RuntimeError(f"{self.name} is gone")

        def loaded():
            if not self.alive:
                raise RuntimeError(f"{self.name} died")
            self.version = version
            return version
        return loaded

    def run_probe(self, probe, version):
        return ProbeResult(gap=0.1 if self.name == "r1" else 0.0, delta=0.0)

    def engine_metrics(self):
        return {"num_blocks": 10, "free_blocks": 4, "preemptions": 0}

    def is_alive(self):
        return self.alive

    def close(self):
        self.alive = False


class NoWeights:
    def write(self, named, version=None):
        self.written = list(named)

    def send(self, version):
        return []

    def close(self):
        pass


def fleet_of(n, **kw):
    lost = []
    fleet = Fleet([FakeReplica(f"r{i}") for i in range(n)], NoWeights(), on_lost=lost.append, **kw)
    return fleet, lost


def test_groups_are_whole_and_spread_by_outstanding_tokens():
    fleet, _ = fleet_of(2)
    prompts = [[i] * (1 + i % 2) for i in range(8)]  # lengths 1, 2, 1, 2, ...
    outs = fleet.generate(prompts, PARAMS)
    assert [o.prompt_token_ids for o in outs] == prompts and all(len(o.completions) == 4 for o in outs)
    calls = [fleet.replicas[i].calls for i in range(2)]
    placed = sorted(p for c in calls for call in c for p in call)
    assert placed == sorted(prompts) and all(len(c) == 1 for c in calls)  # each group once, one call per replica
    # costs n·(prompt + max_tokens): 24, 28, 24, 28, ... placed on the least outstanding replica:
    # r0 24 | r1 28 | r0 48 (24 < 28) | r1 56 | r0 72 | r1 84 | r0 96 | r1 112 (84 < 96)
    assert [sum(4 * (len(p) + 5) for p in c[0]) for c in calls] == [96, 112]
    assert fleet.router.outstanding == [0, 0]


def test_a_fleet_gives_one_engines_outputs():
    torch.manual_seed(0)
    hf = Qwen3ForCausalLM(Qwen3Config(vocab_size=40, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=8, intermediate_size=64)).eval()
    engine = lambda: EngineBackend(hf, device="cpu", dtype=torch.float32, block_size=4, max_num_seqs=32)
    fleet = Fleet([FakeReplica("r0", engine()), FakeReplica("r1", engine())], NoWeights())
    prompts = [[(7 * i + j) % 40 for j in range(3 + i)] for i in range(6)]
    got, want = fleet.generate(prompts, PARAMS), engine().generate(prompts, PARAMS)
    assert all(fleet.replicas[i].calls for i in range(2))
    assert [[c.token_ids for c in o.completions] for o in got] == [[c.token_ids for c in o.completions] for o in want]
    gap = max(abs(a - b) for o, w in zip(got, want) for c, d in zip(o.completions, w.completions)
              for a, b in zip(c.logprobs, d.logprobs))
    assert gap < 1e-5  # other batch shapes round the GEMMs differently; the sampled tokens do not move


def test_a_dead_replicas_groups_are_generated_on_the_others():
    fleet, lost = fleet_of(3)
    fleet.replicas[1].die_on_generate = True
    prompts = [[i, i] for i in range(6)]
    outs = fleet.generate(prompts, PARAMS)
    assert [o.prompt_token_ids for o in outs] == prompts  # one complete output per prompt
    assert fleet.lost == [1] and fleet.regenerated_groups == 2 and len(lost) == 1 and "r1 lost" in lost[0]
    assert fleet.alive == [0, 2] and fleet.router.outstanding == [0, 0, 0]
    served = sorted(p for r in (0, 2) for call in fleet.replicas[r].calls for p in call)
    assert served == sorted(prompts)  # the regenerated groups went to the live replicas, once each
    fleet.generate([[9]], PARAMS)
    assert fleet.step_metrics()["fleet/replicas_lost"] == 1


def test_version_rises_only_when_every_live_replica_acked():
    fleet, _ = fleet_of(3)
    loaded = fleet.start_update([("w", torch.zeros(1))], version=1)
    assert fleet.version == 0  # written and announced, not yet acknowledged
    fleet.replicas[2].alive = False  # dies while loading
    assert loaded() == 1 and fleet.version == 1 and fleet.replica_versions() == {0: 1, 1: 1}
    assert fleet.lost == [2] and fleet.step_metrics()["fleet/version_spread"] == 0
    assert fleet.run_probe(None, 1).gap == 0.1  # the worst replica's gap


def test_sessions_stay_on_their_replica_until_ended():
    fleet, _ = fleet_of(2)
    fleet.generate([[1] * 50, [2]], PARAMS, session_ids=["long", "short"])
    assert fleet.replicas[0].calls == [[[1] * 50]] and fleet.replicas[1].calls == [[[2]]]
    # turn 2 of "long" comes after a new session's big group, which took replica 0 (tie: lowest
    # index, 4·(80+5) = 340 tokens outstanding); stickiness beats load: "long" joins it there
    fleet.generate([[5] * 80, [1] * 50 + [3]], PARAMS, session_ids=["new", "long"])
    assert fleet.replicas[0].calls[-1] == [[5] * 80, [1] * 50 + [3]]
    fleet.end_session("long")  # forgotten: placed by load next time, on the idle replica 1
    fleet.generate([[6] * 80, [4]], PARAMS, session_ids=["new2", "long"])
    assert fleet.replicas[0].calls[-1] == [[6] * 80] and fleet.replicas[1].calls[-1] == [[4]]


def test_losing_every_replica_or_one_the_transport_cannot_drop_is_an_error():
    fleet, _ = fleet_of(1)
    fleet.replicas[0].die_on_generate = True
    with pytest.raises(FleetError, match="every rollout replica is gone"):
        fleet.generate([[1]], PARAMS)
    fleet, _ = fleet_of(2, can_lose_replicas=False)
    fleet.replicas[0].die_on_generate = True
    with pytest.raises(FleetError, match="r0 was lost and the weight transport cannot drop a member"):
        fleet.generate([[1], [2]], PARAMS)
