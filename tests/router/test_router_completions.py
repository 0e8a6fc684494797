"""Several completions per request (sampling.n, beam search) through the router: interleaved
messages told apart by index, a finish_reason per completion, usage once at the end with
every completion's tokens, one response per completion when buffered, and validation of
the new fields and of the max_completions limit."""

from __future__ import annotations

import argparse
import asyncio
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import pytest
from fake_backend import FakeBackend, Seen
from metrics_text import parse_samples, total
from router_harness import serving
from test_cli_generate import run_cli
from test_server_metrics import scrape
from test_validation import request

from tandem.proto import generation_pb2 as pb
from tandem.proto import generation_pb2_grpc as pb_grpc
from tandem.router import serve_command
from tandem.router.buffered import merged_by_index
from tandem.router.limits import RequestLimits, limits_from_args
from tandem.router.validation import validate_request
from tandem.sampling_params import SamplingParams
from tandem.worker.api import StreamDelta

REASONS = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORT}


@dataclass
class ScriptedBackend(FakeBackend):
    """Streams `script` as it is, whatever the request."""

    script: list[StreamDelta] = field(default_factory=list)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       priority: int = 0, num_resumed_tokens: int = 0) -> AsyncIterator[StreamDelta]:
        self.seen.append(Seen(request_id, list(prompt_token_ids), params, priority))
        for delta in self.script:
            yield delta


def run(backend: FakeBackend, req: pb.GenerateRequest, metrics: bool = False
        ) -> tuple[list[pb.GenerateResponse], grpc.aio.AioRpcError | None, str | None]:
    """One call -> (its responses, its error or None, the /metrics text when asked for)."""
    async def body():
        responses: list[pb.GenerateResponse] = []
        error = None
        async with serving(backend, metrics_port=0 if metrics else None) as (channel, server):
            try:
                async for response in pb_grpc.GenerationStub(channel).Generate(req, timeout=30):
                    responses.append(response)
            except grpc.aio.AioRpcError as e:
                error = e
            return responses, error, (await scrape(server) if metrics else None)
    return asyncio.run(body())


def by_index(responses: list[pb.GenerateResponse]) -> dict[int, list[pb.GenerateResponse]]:
    out: dict[int, list[pb.GenerateResponse]] = {}
    for r in responses:
        out.setdefault(r.index, []).append(r)
    return out


def test_streamed_completions_interleave_each_with_its_finish(router_tokenizer):
    backend = FakeBackend(router_tokenizer)
    num_reply = len(router_tokenizer.encode(backend.reply))
    # max_tokens one short of the reply: completions 0 and 1 end "length", completion 2 (the
    # reply less 2 tokens) "stop", first of the three.
    params = SamplingParams(max_tokens=num_reply - 1, n=3)
    expected = [backend.completion_ids(params, i) for i in range(3)]
    assert [reason for _, reason in expected] == ["length", "length", "stop"]
    req = pb.GenerateRequest(request_id="n3", prompt="Hi", sampling=pb.SamplingParams(max_tokens=num_reply - 1, n=3))
    responses, error, text = run(backend, req, metrics=True)
    assert error is None
    assert [r.index for r in responses[:3]] == [0, 1, 2]  # interleaved, as the backend sent them
    groups = by_index(responses)
    assert sorted(groups) == [0, 1, 2]
    for i, (ids, reason) in enumerate(expected):
        mine = groups[i]
        assert [t for r in mine for t in r.token_ids] == ids
        assert "".join(r.text for r in mine) == router_tokenizer.decode(ids)
        assert [r.finish_reason for r in mine] == [pb.FINISH_REASON_UNSPECIFIED] * (len(mine) - 1) + [REASONS[reason]]
    # Completion 2 finished before the end, and the call went on.
    first_finish = next(k for k, r in enumerate(responses) if r.finish_reason != pb.FINISH_REASON_UNSPECIFIED)
    assert responses[first_finish].index == 2 and first_finish < len(responses) - 1
    num_output = sum(len(ids) for ids, _ in expected)
    assert [k for k, r in enumerate(responses) if r.HasField("usage")] == [len(responses) - 1]
    usage = responses[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(router_tokenizer.encode("Hi")), num_output)
    (seen,) = backend.seen
    assert seen.params.n == 3 and seen.params == params
    assert backend.finished == ["n3"] and not backend.closed_early
    # Counted once, with the last completion's finish and every completion's tokens.
    assert text is not None
    s = parse_samples(text)
    assert total(s, "tandem_request_success_total") == 1
    assert total(s, "tandem_request_success_total", finished_reason="length") == 1
    assert total(s, "tandem_request_generation_tokens_sum") == num_output
    assert total(s, "tandem_generation_tokens_total") == num_output


def test_buffered_gives_one_response_per_completion_in_index_order(router_tokenizer):
    backend = FakeBackend(router_tokenizer, worker_failures=[4])  # the first run fails midway: run again
    params = SamplingParams(max_tokens=100, n=3, logprobs=0)
    expected = [backend.completion_ids(params, i) for i in range(3)]
    req = pb.GenerateRequest(request_id="b3", prompt="Hi", buffered=True,
                             sampling=pb.SamplingParams(max_tokens=100, n=3, logprobs=0))
    responses, error, _ = run(backend, req)
    assert error is None
    assert [r.index for r in responses] == [0, 1, 2]
    for r, (ids, reason) in zip(responses, expected):
        assert list(r.token_ids) == ids and r.text == router_tokenizer.decode(ids) and len(r.logprobs) == len(ids)
        assert r.finish_reason == REASONS[reason]
    assert [r.HasField("usage") for r in responses] == [False, False, True]
    assert responses[-1].usage.completion_tokens == sum(len(ids) for ids, _ in expected)
    assert len(backend.seen) == 2 and backend.finished == ["b3"]


def test_merged_by_index_counts_down_to_the_request_finish():
    def delta(index, ids, reason=None, unfinished=1, total_tokens=0):
        return StreamDelta(request_id="m", token_ids=ids, text="".join(map(str, ids)), finish_reason=reason,
                           num_prompt_tokens=2, num_output_tokens=total_tokens, index=index, num_unfinished=unfinished)

    # Completion 1 finishes first; the request ends with completion 0.
    run_deltas = [delta(1, [5], total_tokens=1), delta(0, [7], total_tokens=2),
                  delta(1, [6], "stop", unfinished=1, total_tokens=3), delta(0, [8], total_tokens=4),
                  delta(0, [9], "length", unfinished=0, total_tokens=5)]
    out = merged_by_index(run_deltas)
    assert [(d.index, d.token_ids, d.text, d.finish_reason) for d in out] == [
        (0, [7, 8, 9], "789", "length"), (1, [5, 6], "56", "stop")]
    assert [d.num_unfinished for d in out] == [1, 0] and [d.request_finished for d in out] == [False, True]
    assert [d.num_output_tokens for d in out] == [5, 5]
    # A run that never finished stays unfinished however it is merged.
    assert not any(d.request_finished for d in merged_by_index(run_deltas[:4]))
    assert merged_by_index([]) == []


def test_a_stream_that_ends_before_every_completion_finished_is_internal(router_tokenizer):
    backend = ScriptedBackend(router_tokenizer, script=[
        StreamDelta(request_id="s", token_ids=[5], text="a", finish_reason="stop", num_prompt_tokens=1,
                    num_output_tokens=1, index=1, num_unfinished=1),
        StreamDelta(request_id="s", token_ids=[6], text="b", finish_reason=None, num_prompt_tokens=1,
                    num_output_tokens=2, index=0, num_unfinished=1),
    ])
    responses, error, _ = run(backend, pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingParams(n=2)))
    assert [(r.index, r.finish_reason) for r in responses] == [(1, pb.FINISH_REASON_STOP), (0, 0)]
    assert not any(r.HasField("usage") for r in responses)
    assert error is not None and error.code() == grpc.StatusCode.INTERNAL
    assert "before every completion finished" in error.details()


def test_abort_ends_every_unfinished_completion(router_tokenizer):
    backend = FakeBackend(router_tokenizer, step_delay_s=0.02)

    async def body():
        async with serving(backend) as (channel, _):
            stub = pb_grpc.GenerationStub(channel)
            call = stub.Generate(pb.GenerateRequest(request_id="a2", prompt="Hi",
                                                    sampling=pb.SamplingParams(max_tokens=100, n=2)))
            responses = [await call.read()]
            await stub.Abort(pb.AbortRequest(request_ids=["a2"]))
            while (response := await call.read()) is not grpc.aio.EOF:
                responses.append(response)
            return responses, await call.code()

    responses, code = asyncio.run(body())
    assert code == grpc.StatusCode.OK
    finishes = {r.index: r.finish_reason for r in responses if r.finish_reason != pb.FINISH_REASON_UNSPECIFIED}
    assert finishes == {0: pb.FINISH_REASON_ABORT, 1: pb.FINISH_REASON_ABORT}
    assert responses[-1].HasField("usage") and not any(r.HasField("usage") for r in responses[:-1])
    assert backend.finished == ["a2"] and not backend.closed_early


def test_client_cancel_mid_stream_closes_the_backend_stream(router_tokenizer):
    backend = FakeBackend(router_tokenizer, step_delay_s=0.02)

    async def body():
        async with serving(backend) as (channel, _):
            call = pb_grpc.GenerationStub(channel).Generate(
                pb.GenerateRequest(request_id="c2", prompt="Hi", sampling=pb.SamplingParams(max_tokens=100, n=2)))
            # Past completion 0's and 1's first tokens: neither has finished.
            for _ in range(3):
                await call.read()
            call.cancel()
            assert backend.closed_event is not None  # set by the first generate
            await asyncio.wait_for(backend.closed_event.wait(), 5)

    asyncio.run(body())
    assert backend.closed_early == ["c2"] and not backend.finished


# (case, sampling fields, the field the error names, text the message holds)
BAD_COMPLETIONS = [
    ("n zero", {"n": 0}, "sampling.n", ">= 1"),
    ("n negative", {"n": -2}, "sampling.n", ">= 1"),
    ("beam_width zero", {"beam_width": 0}, "sampling.beam_width", ">= 1"),
    ("n past beam_width", {"use_beam_search": True, "temperature": 0.0, "n": 5, "beam_width": 4}, "sampling.n",
     "beam_width"),
    ("temperature 1 with beam search", {"use_beam_search": True, "temperature": 1.0}, "sampling.temperature", "beam"),
    ("temperature unset with beam search", {"use_beam_search": True}, "sampling.temperature", "beam"),
    ("stop with beam search", {"use_beam_search": True, "temperature": 0.0, "stop": ["x"]}, "sampling.stop", "beam"),
    ("length_penalty NaN", {"length_penalty": math.nan}, "sampling.length_penalty", "finite"),
    ("n past max_completions", {"n": 17}, "sampling.n", "max_completions=16"),
    ("n far past max_completions", {"n": 2**31 - 1}, "sampling.n", "max_completions=16"),
    ("beam_width past max_completions", {"use_beam_search": True, "temperature": 0.0, "beam_width": 17},
     "sampling.beam_width", "max_completions=16"),
]


@pytest.mark.parametrize("sampling, field, text", [c[1:] for c in BAD_COMPLETIONS], ids=[c[0] for c in BAD_COMPLETIONS])
def test_bad_completion_fields_are_named(router_tokenizer, sampling, field, text):
    with pytest.raises(ValueError) as error:
        validate_request(request(prompt="hi", sampling=sampling), router_tokenizer)
    message = str(error.value)
    assert message.startswith(f"{field}: ") and text in message, message


def test_a_tighter_max_completions_bounds_n_and_the_default_beam_width(router_tokenizer):
    limits = RequestLimits(max_completions=2)
    validate_request(request(prompt="hi", sampling={"n": 2}), router_tokenizer, limits)
    with pytest.raises(ValueError, match=r"^sampling\.n: 3 completions, .*max_completions=2"):
        validate_request(request(prompt="hi", sampling={"n": 3}), router_tokenizer, limits)
    # Unset, beam_width is SamplingParams' 4: past the limit too.
    with pytest.raises(ValueError, match=r"^sampling\.beam_width: 4 beams \(the default\), .*max_completions=2"):
        validate_request(request(prompt="hi", sampling={"use_beam_search": True, "temperature": 0.0}),
                         router_tokenizer, limits)
    # Without beam search beam_width is unused, so it costs nothing and is not bounded.
    validate_request(request(prompt="hi", sampling={"beam_width": 100}), router_tokenizer, limits)


def test_the_completion_fields_arrive(router_tokenizer):
    sampling = {"n": 2, "use_beam_search": True, "beam_width": 3, "length_penalty": 0.5, "temperature": 0.0}
    params = validate_request(request(prompt="hi", sampling=sampling), router_tokenizer).params
    assert params == SamplingParams(n=2, use_beam_search=True, beam_width=3, length_penalty=0.5, temperature=0.0)
    assert params.num_completions == 3
    params = validate_request(request(prompt="hi", sampling={"n": 16, "seed": 7}), router_tokenizer).params
    assert (params.n, params.use_beam_search, params.beam_width, params.length_penalty) == (16, False, 4, 1.0)


def test_the_context_check_is_per_completion(router_tokenizer):
    # n completions each fit the context on their own: prompt + max_tokens, not n times that.
    params = validate_request(request(token_ids=[5] * 200, sampling={"max_tokens": 56, "n": 3}),
                              router_tokenizer).params
    assert (params.n, params.max_tokens) == (3, 56)
    with pytest.raises(ValueError, match=r"^sampling\.max_tokens: "):
        validate_request(request(token_ids=[5] * 200, sampling={"max_tokens": 57, "n": 3}), router_tokenizer)


def test_past_the_limit_is_invalid_argument_and_reaches_no_worker(router_tokenizer):
    backend = FakeBackend(router_tokenizer)
    responses, error, _ = run(backend, pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingParams(n=17)))
    assert responses == [] and error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith("sampling.n: ") and "max_completions=16" in error.details()
    assert backend.seen == []


def test_max_completions_is_a_serve_flag():
    parser = argparse.ArgumentParser()
    serve_command.add_args(parser)
    assert limits_from_args(parser.parse_args(["--max-completions", "4"])) == RequestLimits(max_completions=4)
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-completions", "0"])
    with pytest.raises(ValueError, match="RequestLimits.max_completions must be"):
        RequestLimits(max_completions=0)


def test_cli_prints_each_completion_under_its_index(router_tokenizer):
    backend = FakeBackend(router_tokenizer)

    async def body():
        async with serving(backend) as (_, server):
            from tandem.router.server import bound_port
            return await run_cli("Hi", "--server", f"127.0.0.1:{bound_port(server)}", "--max-tokens", "3", "--n", "2")

    code, out, err = asyncio.run(body())
    assert code == 0, err
    params = SamplingParams(max_tokens=3, n=2)
    blocks = [f"--- [{i}] finish_reason=length\n{router_tokenizer.decode(backend.completion_ids(params, i)[0])}\n"
              for i in range(2)]
    assert out == "".join(blocks)
    assert "finish_reason=length" in err and "completion_tokens=6" in err
    assert backend.seen[0].params.n == 2
