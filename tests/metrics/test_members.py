"""Per-member metric keys: what the fleet writes is what the profile reads back; sums over members."""
from asyncrl.metrics.fleet import FleetProfile
from asyncrl.metrics.members import member_key, member_totals, member_values


def test_keys_written_per_member_are_read_back_and_others_ignored():
    metrics = {member_key("fleet", "replica0", "busy"): 0.9, member_key("fleet", "replica1", "busy"): 0.5,
               "fleet/replica0/tokens_per_s": 100.0, "fleet/busy_replica_seconds": 2.8, "reward/replica0/busy": 7.0}
    assert "fleet/replica1/busy" in metrics
    assert member_values(metrics, "fleet", "busy") == {"replica0": 0.9, "replica1": 0.5}


def test_totals_sum_each_counter_over_members():
    per = {"math": {"calls": 4, "seconds": 0.5, "nones": 1}, "format": {"calls": 4, "seconds": 0.25, "nones": 0}}
    assert member_totals(per, ("calls", "seconds")) == {"calls": 8, "seconds": 0.75}
    assert member_totals({}, ("calls",)) == {"calls": 0}


def test_fleet_profile_averages_each_replicas_busy_fraction_over_steps():
    profile = FleetProfile()
    for busy0, busy1 in ((1.0, 0.5), (0.8, 0.7)):  # per step: replica0 90% on average, replica1 60%
        profile.observe({"fleet/busy_replica_seconds": 3.0, "async/trainer_busy_seconds": 1.0,
                         "fleet/replicas_alive": 2.0, "fleet/replicas_lost": 0.0,
                         member_key("fleet", "replica0", "busy"): busy0, member_key("fleet", "replica1", "busy"): busy1})
    busy = profile.summary()["busy"]
    assert busy.keys() == {"replica0", "replica1"}
    assert abs(busy["replica0"] - 0.9) < 1e-12 and abs(busy["replica1"] - 0.6) < 1e-12
