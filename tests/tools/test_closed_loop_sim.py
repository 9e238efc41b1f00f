"""tools/closed_loop_sim.py: the closed-loop arithmetic of docs/perf-log.md "The refill wait"."""
import importlib.util
import os

spec = importlib.util.spec_from_file_location(
    "closed_loop_sim", os.path.join(os.path.dirname(__file__), "..", "..", "tools", "closed_loop_sim.py"))
sim = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sim)

DECODE, MIXED = 0.01133, 0.0376


def test_without_the_wait_each_arrival_waits_for_the_one_before_it():
    ttft, otps, held = sim.simulate(16, 600, DECODE, MIXED, 0.0005, 0.0, 0.02)
    assert 1.9 * MIXED <= ttft <= 2.05 * MIXED
    assert held == 0
    # each request's decode time: 599 steps, 15 of them the other clients' mixed steps
    assert abs(otps - 599 / (599 * DECODE + 15 * (MIXED - DECODE))) < 0.5


def test_the_wait_puts_the_next_prompt_into_the_next_step():
    ttft, otps, held = sim.simulate(16, 600, DECODE, MIXED, 0.0005, 0.003, 0.02)
    assert MIXED - 1e-9 <= ttft <= MIXED + 0.001
    assert 0.0004 <= held <= 0.0006
    base = sim.simulate(16, 600, DECODE, MIXED, 0.0005, 0.0, 0.02)[1]
    assert 0.99 * base <= otps < base  # the finishing request's last step is now the next prompt's


def test_a_client_slower_than_the_limit_gains_nothing_and_costs_at_most_the_limit():
    ttft, otps, held = sim.simulate(16, 600, DECODE, MIXED, 0.005, 0.003, 0.02)
    assert ttft >= 1.9 * MIXED
    assert held <= 0.003 + 1e-9


def test_the_budget_bounds_the_holds():
    # no replacements ever come in time (rtt 1 s): every hold times out, and the holds stay within the
    # share of the step time plus the banked holds
    _, _, held = sim.simulate(16, 100, DECODE, MIXED, 1.0, 0.003, 0.0, requests=200, warmup=0)
    assert held * 200 <= sim.BANKED_HOLDS * 0.003 + 1e-9
