"""The weight stream of a sharded actor (2 and 4 gloo ranks): every rank gathers the same
tensors in the same order (the collective order the engine sync relies on), the full tensors
equal the gathered weights, in buckets or not, and the publisher's backend on rank 0 receives
every tensor with the version while the other ranks drain the stream."""
import pytest


@pytest.mark.parametrize("world", ["world2", "world4"])
def test_stream_is_the_full_weights_in_one_order(world, request):
    stream = request.getfixturevalue(world)["stream"]
    first = stream["order"][0]
    assert all(order == first for order in stream["order"])
    assert set(first) == set(stream["weights"]) and len(first) == len(set(first))
    for name, tensor in stream["streamed"].items():
        assert tensor.equal(stream["weights"][name]), name


@pytest.mark.parametrize("world", ["world2", "world4"])
def test_publisher_loads_every_tensor_on_rank_zero(world, request):
    stream = request.getfixturevalue(world)["stream"]
    assert stream["version"] == 7
    assert stream["published"].keys() == stream["weights"].keys()
    for name, tensor in stream["published"].items():
        assert tensor.equal(stream["weights"][name]), name
