"""Gate: stopping behaviour, checked on the engine against its own unconstrained output.

One greedy run with ignore_eos gives the token stream T and its text X. Then:
- EOS: the same prompt without ignore_eos must end exactly at T's first EOS (finish "stop", EOS not in the text),
  or run to max_tokens when T has none;
- exact max_tokens: runs with max_tokens n give exactly n tokens, the first n of T, finish "length";
- stop strings: strings cut from X across a token boundary must end the text exactly before their first
  occurrence, with finish "stop"; a string that only ever matches partially must not hold text back at the end;
- streaming: each case run again through add_request/step; the concatenated deltas, the tokens and the finish
  reason must equal the non-streaming result, and every prefix streamed must be a prefix of the final text
  (no partial stop string ever leaves the engine).
The cases of one prompt run as one batch (non-streaming) and one batch of streams, to keep the gate cheap.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from envex.runtime.engine import SamplingParams
from envex.verify.common import Streamed, Timer, chat_ids, stream_many
from envex.verify.types import GateEngine, GateResult

NAME = "stopping"


def boundary_stops(tokenizer: Any, tokens: list[int], text: str, count: int) -> list[str]:
    """Stop strings of 4 characters that straddle a token boundary and first occur there in `text`."""
    stops: list[str] = []
    for i in range(2, len(tokens) - 1):
        head = tokenizer.decode(tokens[:i])
        b = len(head)
        if not text.startswith(head) or b < 2 or b + 2 > len(text):
            continue
        s = text[b - 2:b + 2]
        if s.strip() and text.find(s) == b - 2 and s not in stops:
            stops.append(s)
        if len(stops) == count:
            break
    return stops


def _judge(kind: str, params: SamplingParams, expect: dict[str, Any], got: Any, streamed: Streamed) -> dict[str, Any]:
    problems = []
    if "text" in expect and got.text != expect["text"]:
        problems.append("text differs from the expected cut")
    if "n_tokens" in expect and len(got.token_ids) != expect["n_tokens"]:
        problems.append(f"{len(got.token_ids)} tokens, expected {expect['n_tokens']}")
    if "tokens" in expect and got.token_ids != expect["tokens"]:
        problems.append("tokens differ from the unconstrained run")
    if "finish_reason" in expect and got.finish_reason != expect["finish_reason"]:
        problems.append(f"finish_reason {got.finish_reason!r}, expected {expect['finish_reason']!r}")
    if (streamed.text, streamed.token_ids, streamed.finish_reason) != (got.text, got.token_ids, got.finish_reason):
        problems.append("streaming differs from non-streaming")
    acc = ""
    for delta in streamed.deltas:
        acc += delta
        if not got.text.startswith(acc):
            problems.append("a streamed delta is not a prefix of the final text (text leaked)")
            break
    for s in params.stop:
        if s in got.text or s in streamed.text:
            problems.append(f"stop string {s!r} appears in the output")
    return {
        "kind": kind, "max_tokens": params.max_tokens, "stop": list(params.stop), "ignore_eos": params.ignore_eos,
        "expected": {k: v for k, v in expect.items() if k != "tokens"}, "text": got.text,
        "n_tokens": len(got.token_ids), "finish_reason": got.finish_reason, "streamed_text": streamed.text,
        "stream_deltas": len(streamed.deltas), "problems": problems, "ok": not problems,
    }


def _cases(tok: Any, tokens: list[int], max_tokens: int, token_counts: Sequence[int], stops_per_prompt: int,
           unbuilt: list[str]) -> list[tuple[str, SamplingParams, dict[str, Any]]]:
    """The cases of one prompt; a case that cannot be built from the unconstrained output is named in `unbuilt`
    with the reason (the gate's summary says so, instead of counting only what ran)."""
    eos = set(tok.eos_token_ids)
    first_eos = next((i for i, t in enumerate(tokens[:max_tokens]) if t in eos), None)
    greedy = {"temperature": 0.0, "max_tokens": max_tokens}
    cases: list[tuple[str, SamplingParams, dict[str, Any]]] = [(
        "eos", SamplingParams(**greedy),
        {"n_tokens": first_eos + 1, "tokens": tokens[:first_eos + 1], "finish_reason": "stop"}
        if first_eos is not None else {"n_tokens": max_tokens, "tokens": tokens[:max_tokens],
                                       "finish_reason": "length"},
    )]
    for n in token_counts:
        cases.append(("max_tokens", SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                      {"n_tokens": n, "tokens": tokens[:n], "finish_reason": "length"}))
    visible = tokens[:first_eos if first_eos is not None else max_tokens]  # what a client sees: up to the EOS
    text = tok.decode(visible)
    stops = boundary_stops(tok, visible, text, stops_per_prompt)
    for s in stops:
        cases.append(("stop_string", SamplingParams(**greedy, stop=(s,)),
                      {"text": text[:text.find(s)], "finish_reason": "stop"}))
    if len(stops) < stops_per_prompt:
        unbuilt.append(
            f"{stops_per_prompt - len(stops)} of {stops_per_prompt} stop_string: the output before EOS "
            f"({len(visible)} tokens, {len(text)} characters) has no other 4-character string that crosses a token "
            "boundary and first occurs there"
        )
    if len(text) >= 3:  # the start of a stop string that never completes: nothing may be held back at the end
        cases.append(("stop_partial_only", SamplingParams(**greedy, stop=(text[-3:] + "\u2603\u2603",)),
                      {"text": text, "finish_reason": "stop" if first_eos is not None else "length"}))
    else:
        unbuilt.append(f"stop_partial_only: the output before EOS has {len(text)} characters, fewer than 3")
    return cases


def check_stopping(engine: GateEngine, *, prompts: Sequence[str], max_tokens: int = 32,
                   token_counts: Sequence[int] = (1, 2, 7), stops_per_prompt: int = 2) -> GateResult:
    timer = Timer()
    tok = engine.tokenizer
    results: list[dict[str, Any]] = []
    unbuilt: list[dict[str, str]] = []  # cases that could not be built, with why: never counted as exact
    for prompt in prompts:
        ids = chat_ids(tok, prompt)
        longest = max(max_tokens, *token_counts)  # the unconstrained run covers every case's length
        base = engine.generate([ids], SamplingParams(max_tokens=longest, temperature=0.0, ignore_eos=True))[0]
        missing: list[str] = []
        cases = _cases(tok, base.token_ids, max_tokens, token_counts, stops_per_prompt, missing)
        unbuilt += [{"prompt": prompt, "case": why} for why in missing]
        got = engine.generate([ids] * len(cases), [p for _, p, _ in cases])
        streamed = stream_many(engine, [(ids, p) for _, p, _ in cases])
        for (kind, params, expect), g, st in zip(cases, got, streamed, strict=True):
            results.append({"prompt": prompt, **_judge(kind, params, expect, g, st)})
    failed = [c for c in results if not c["ok"]]
    kinds = {c["kind"] for c in results}
    required = ("eos", "max_tokens", "stop_string")
    absent = [k for k in required if k not in kinds]
    summary = (f"{len(results) - len(failed)}/{len(results)} stopping cases run exact ({', '.join(sorted(kinds))}; "
               "streaming compared)")
    if unbuilt:
        summary += f"; not built: {len(unbuilt)} ({'; '.join(u['case'] for u in unbuilt[:2])}"
        summary += ", ...)" if len(unbuilt) > 2 else ")"
    if absent:
        summary += f"; fails: no {', '.join(absent)} case ran (the gate needs each kind)"
    return GateResult(
        name=NAME,
        verdict="pass" if not failed and not absent else "fail",
        thresholds={"rule": "every case exact: tokens, text, finish reason; streaming == non-streaming; "
                    "no stop string or part of one emitted; at least one case of each kind: "
                    + ", ".join(required), "max_tokens": max_tokens,
                    "token_counts": list(token_counts)},
        evidence={"cases": results, "failed": len(failed), "total": len(results), "kinds_covered": sorted(kinds),
                  "not_built": unbuilt},
        seconds=timer.seconds,
        summary=summary,
    )
