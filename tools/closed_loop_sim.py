#!/usr/bin/env python3
"""The serving loop under closed-loop clients, from step times alone: TTFT and OTPS medians.

A model of `loramux serve` + `bench serve --max-concurrency C` (docs/perf-log.md, "The refill wait"):
C clients each send a request, wait for its last token, and send the next one `--rtt-ms` later. The engine
runs synchronous steps: a step that admits a prompt (one per step, FIFO; the prompt fits a step whole) is
a mixed step of `--mixed-ms`, otherwise a decode step of `--decode-ms`. A request's first token comes at the
end of its mixed step, then one token per step. A request that arrives while a step runs waits for the
step to end. With `--refill-wait-ms W`, after a step that finished F requests, with nothing waiting and
sequences still decoding, the engine holds until F new requests arrived or W passed, paid from a budget
that grows by `--refill-wait-share` of each step's time and banks up to 64 holds (server/engine_loop.h).

Usage: tools/closed_loop_sim.py [--clients 16] [--output-len 600] [--decode-ms 11.33] [--mixed-ms 37.6]
                                [--rtt-ms 0.5] [--refill-wait-ms 3] [--refill-wait-share 0.02]
Defaults: the yardstick on the H200 (perf-log run 117's decode and mixed steps).
"""
import argparse
import bisect
import statistics

BANKED_HOLDS = 64


def simulate(clients, output_len, decode_s, mixed_s, rtt_s, refill_wait_s, refill_share, requests=400, warmup=64):
    """Returns (TTFT median s, OTPS median, held seconds per request) over `requests` after `warmup`."""
    t = 0.0
    arrivals = [0.0] * clients  # sorted times of requests not yet in the engine (all clients start at 0)
    waiting, running, done, reqs = [], {}, [], []
    banked = BANKED_HOLDS * refill_wait_s
    budget, held_total = banked, 0.0
    while len(done) < requests + warmup:
        while arrivals and arrivals[0] <= t:
            reqs.append({"arrival": arrivals.pop(0)})
            waiting.append(len(reqs) - 1)
        if not running and not waiting:
            t = arrivals[0]
            continue
        admit = waiting.pop(0) if waiting else None
        step = mixed_s if admit is not None else decode_s
        t += step
        finished = []
        for r in list(running):
            running[r] -= 1
            if running[r] == 0:
                finished.append(r)
                del running[r]
        if admit is not None:
            reqs[admit]["first"] = t
            running[admit] = output_len - 1
        for r in finished:
            reqs[r]["end"] = t
            done.append(r)
            bisect.insort(arrivals, t + rtt_s)
        budget = min(banked, budget + refill_share * step)
        if refill_wait_s > 0 and finished and running and not waiting:
            limit = min(refill_wait_s, budget)
            later = [a for a in arrivals if a > t][:len(finished)]
            held = later[-1] - t if len(later) == len(finished) and later[-1] - t <= limit else limit
            t += held
            budget -= held
            held_total += held
    timed = [reqs[r] for r in done[warmup:]]
    ttft = statistics.median(r["first"] - r["arrival"] for r in timed)
    otps = statistics.median((output_len - 1) / (r["end"] - r["first"]) for r in timed)
    return ttft, otps, held_total / len(done)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--output-len", type=int, default=600)
    p.add_argument("--decode-ms", type=float, default=11.33)
    p.add_argument("--mixed-ms", type=float, default=37.6)
    p.add_argument("--rtt-ms", type=float, default=0.5, help="a client's last token to its next request in the engine")
    p.add_argument("--refill-wait-ms", type=float, default=3.0)
    p.add_argument("--refill-wait-share", type=float, default=0.02)
    p.add_argument("--requests", type=int, default=400)
    a = p.parse_args()
    for wait_ms in (0.0, a.refill_wait_ms):
        ttft, otps, held = simulate(a.clients, a.output_len, a.decode_ms / 1e3, a.mixed_ms / 1e3, a.rtt_ms / 1e3,
                                    wait_ms / 1e3, a.refill_wait_share, a.requests)
        print(f"refill wait {wait_ms:g} ms: TTFT median {ttft * 1e3:.1f} ms, OTPS median {otps:.2f}, "
              f"held {held * 1e3:.2f} ms a request")


if __name__ == "__main__":
    main()
