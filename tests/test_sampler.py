"""shadow.max_per_minute: a sampled request is shadowed while the route's token bucket has a token;
the bucket refills at max_per_minute / 60 per second and holds one second's worth."""

from __future__ import annotations

from service.config import Config, parse_config
from service.proxy.sampler import ShadowSampler


def config(max_per_minute: int) -> Config:
    return parse_config({
        "providers": {"p": {"base_url": "http://127.0.0.1:9/v1"}},
        "models": {"s": {"provider": "p", "name": "a"}, "c": {"provider": "p", "name": "b"}},
        "routes": {"r": {"stable": "s", "candidate": "c", "shadow": {"sample_rate": 1.0, "max_per_minute": max_per_minute}}},
    })


def sampler(max_per_minute: int) -> ShadowSampler:
    return ShadowSampler(config(max_per_minute))


def test_a_burst_gets_one_seconds_worth_then_the_cap_is_spread_over_the_minute():
    s = sampler(600)
    assert sum(s.admit("r", now=50.0) for _ in range(100)) == 10  # not the whole minute's 600
    # 100 sampled requests a second for a minute: 10 a second are shadowed, 600 in the minute
    admitted = [s.admit("r", now=50.0 + k / 100) for k in range(1, 6001)]
    assert sum(admitted) == 600
    per_second = [sum(admitted[i:i + 100]) for i in range(0, 6000, 100)]
    assert min(per_second) >= 9 and max(per_second) <= 11, per_second


def test_a_quiet_route_is_shadowed_on_every_sampled_request_under_the_cap():
    s = sampler(600)
    assert all(s.admit("r", now=10.0 + k * 0.2) for k in range(300))  # 5 a second, under 10


def test_a_cap_of_zero_shadows_nothing_and_a_reload_starts_full():
    s = sampler(0)
    assert not any(s.admit("r", now=float(k)) for k in range(100))
    s.reload(config(60))
    assert s.admit("r", now=0.0) and not s.admit("r", now=0.0)  # one second's worth of 60/min: one
    assert s.admit("r", now=1.0)


def test_several_candidates_share_a_small_cap_without_rounding_it_away():
    """max_per_minute 1 over two candidates: one sampled request every two minutes (each shadows
    both), not none."""
    cfg = parse_config({
        "providers": {"p": {"base_url": "http://127.0.0.1:9/v1"}},
        "models": {"s": {"provider": "p", "name": "a"}, "c1": {"provider": "p", "name": "b"},
                   "c2": {"provider": "p", "name": "c"}},
        "routes": {"r": {"stable": "s", "candidates": ["c1", "c2"], "rollout": {"scope": "segment"},
                         "shadow": {"sample_rate": 1.0, "max_per_minute": 1}}},
    })
    s = ShadowSampler(cfg)
    admitted = [s.admit("r", now=float(t)) for t in range(0, 600)]  # one sampled request a second, 10 minutes
    assert sum(admitted) == 5
