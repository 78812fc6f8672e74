"""HostOverheadCost: an engine's host work after the GPU step (sum) or hidden behind it (max)."""

import pytest

from servelab.cost.host_overhead import HostCost, HostOverheadCost
from servelab.cost.roofline import Roofline
from servelab.errors import InvalidArgument
from servelab.spec.hardware import get_hardware
from servelab.spec.model import get_model

MODEL = get_model("llama-3.1-8b")


@pytest.fixture(scope="module")
def roofline() -> Roofline:
    return Roofline(MODEL, get_hardware("h100-sxm"))


SHAPES = {
    "small decode": [(1, 512)] * 4,  # the GPU step is short: a large host cost shows
    "big decode": [(1, 2048)] * 256,
    "prefill": [(2048, 2048)],
    "mixed": [(1, 1000)] * 64 + [(512, 1536)],
}


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("host", [HostCost(5e-3, 2e-5, 4e-5), HostCost(1e-4, 0.0, 1e-6)])
def test_overlapped_host_costs_max_of_gpu_and_host_serial_costs_the_sum(roofline, shape, host):
    gpu_s = roofline.step_time_s(shape)
    host_s = host.time_s(MODEL.num_layers, len(shape))
    serial = HostOverheadCost(roofline, host, MODEL.num_layers)
    overlapped = HostOverheadCost(
        roofline, HostCost(host.step_s, host.per_layer_s, host.per_seq_s, overlapped=True), MODEL.num_layers
    )
    assert serial.step_time_s(shape) == pytest.approx(gpu_s + host_s, rel=1e-12)
    assert overlapped.step_time_s(shape) == pytest.approx(max(gpu_s, host_s), rel=1e-12)
    # The fast path the simulator takes gives the same time, and step() reports it with the
    # host time that shows as overhead.
    totals = Roofline.totals(shape)
    for model in (serial, overlapped):
        assert model.time_from_totals(*totals) == model.step_time_s(shape)
        cost = model.step(shape)
        assert cost.time_s == pytest.approx(model.step_time_s(shape), rel=1e-12)
        assert cost.overhead_s - roofline.step(shape).overhead_s == pytest.approx(cost.time_s - gpu_s, abs=1e-15)


def test_a_short_gpu_step_is_host_bound_when_overlapped(roofline):
    shape = SHAPES["small decode"]
    host = HostCost(step_s=0.05, overlapped=True)
    assert roofline.step_time_s(shape) < 0.05
    assert HostOverheadCost(roofline, host, MODEL.num_layers).step_time_s(shape) == 0.05


def test_an_empty_step_costs_nothing(roofline):
    model = HostOverheadCost(roofline, HostCost(1e-3, 1e-5, 1e-5), MODEL.num_layers)
    assert model.time_from_totals(0, 0, 0, 0) == 0.0


def test_the_fast_path_exists_only_when_the_gpu_model_has_it(roofline):
    class ShapeOnly:
        def step_time_s(self, shape):
            return 1e-3 * len(shape)

        def step(self, shape):
            raise NotImplementedError

    assert not hasattr(HostOverheadCost(ShapeOnly(), HostCost(), 32), "time_from_totals")
    assert HostOverheadCost(ShapeOnly(), HostCost(1e-3), 32).step_time_s([(1, 10)] * 2) == pytest.approx(3e-3)


def test_negative_host_costs_are_refused_naming_the_field():
    with pytest.raises(InvalidArgument, match="per_seq_s must be >= 0"):
        HostCost(per_seq_s=-1e-6)
