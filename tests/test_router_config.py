"""Router configurations of the trainer: the synthetic bias layouts and the balanced bound (validation on
the config; the routing they produce is checked end to end in tests/test_paper_eval.py)."""

import pytest

from app.config import RouterConfig


def test_layouts_and_balanced_accepted():
    assert RouterConfig(name="balanced").layout == "megatron"
    assert RouterConfig(name="synthetic", router_skew=-4.0, layout="concentrated").layout == "concentrated"
    assert RouterConfig(name="synthetic", router_skew=0.0, layout="concentrated").router_skew == 0.0


@pytest.mark.parametrize("kw, msg", [
    (dict(name="uniform"), "router.name must be natural, synthetic or balanced"),
    (dict(name="synthetic"), "needs router.router_skew"),
    (dict(name="synthetic", router_skew=-4.0, layout="diagonal"), "router.layout must be megatron or one of"),
    (dict(name="natural", layout="concentrated"), "needs router=synthetic"),
    (dict(name="synthetic", router_skew=2.0, layout="concentrated"), "needs router.router_skew <= 0"),
    (dict(name="synthetic", router_skew=-4.0, seed=3), "router.seed=3 seeds the bias of our layouts"),
])
def test_bad_router_configs_name_the_field(kw, msg):
    with pytest.raises(ValueError, match=msg):
        RouterConfig(**kw)
