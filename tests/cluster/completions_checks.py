"""Reading a call's several completions (sampling.n) off its gRPC responses."""

from __future__ import annotations

from tandem.proto import generation_pb2 as pb

FINISHED = (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)


def sampled_request(prompt: list[int], seed: int, n: int, max_tokens: int, buffered: bool = False
                    ) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), buffered=buffered,
                              sampling=pb.SamplingParams(temperature=0.8, seed=seed, n=n, max_tokens=max_tokens))


def by_index(responses: list[pb.GenerateResponse]) -> dict[int, list[pb.GenerateResponse]]:
    found: dict[int, list[pb.GenerateResponse]] = {}
    for r in responses:
        found.setdefault(r.index, []).append(r)
    return found


def completions(responses: list[pb.GenerateResponse], n: int) -> list[tuple[list[int], str, int]]:
    """A call's responses -> each completion's (token ids, text, finish_reason), by index,
    checking the framing: indexes 0..n-1, one finish_reason per completion on its last
    message, usage only on the call's last message, counting every completion's tokens."""
    groups = by_index(responses)
    assert sorted(groups) == list(range(n))
    result: list[tuple[list[int], str, int]] = []
    for index in range(n):
        messages = groups[index]
        assert [r.finish_reason for r in messages[:-1]] == [pb.FINISH_REASON_UNSPECIFIED] * (len(messages) - 1)
        assert messages[-1].finish_reason in FINISHED, (index, messages[-1])
        result.append(([t for r in messages for t in r.token_ids], "".join(r.text for r in messages),
                       messages[-1].finish_reason))
    assert [r.HasField("usage") for r in responses] == [False] * (len(responses) - 1) + [True]
    assert responses[-1].usage.completion_tokens == sum(len(ids) for ids, _, _ in result)
    assert all(r.request_id == responses[0].request_id for r in responses)
    return result
