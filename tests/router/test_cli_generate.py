"""`tandem generate` end to end: a real CLI process against a router over the fake backend."""

from __future__ import annotations

import asyncio
import sys

from fake_backend import FakeBackend
from router_harness import running_router


async def run_cli(*args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tandem", "generate", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None  # communicate() waited for the exit
    return process.returncode, stdout.decode(), stderr.decode()


def test_generate_streams_text_then_usage_and_reports_errors(router_tokenizer):
    backend = FakeBackend(router_tokenizer)

    async def body():
        async with running_router(backend) as (_, port):
            server = f"127.0.0.1:{port}"
            # Both processes at once: each spends most of its start importing.
            return await asyncio.gather(
                run_cli("Capital of France?", "--server", server, "--max-tokens", "5", "--chat",
                        "--temperature", "0.7", "--top-p", "0.9", "--top-k", "20", "--seed", "1", "--timeout", "30"),
                run_cli("hi", "--server", server, "--max-tokens", "-1"),
            )

    (code, out, err), (bad_code, bad_out, bad_err) = asyncio.run(body())
    assert code == 0, err
    assert out == router_tokenizer.decode(router_tokenizer.encode(backend.reply)[:5]) + "\n"
    prompt_tokens = len(router_tokenizer.apply_chat_template([{"role": "user", "content": "Capital of France?"}]))
    assert f"finish_reason=length prompt_tokens={prompt_tokens} completion_tokens=5" in err
    (seen,) = backend.seen
    assert (seen.params.temperature, seen.params.top_p, seen.params.top_k, seen.params.seed) == (0.7, 0.9, 20, 1)
    assert bad_code != 0
    assert "INVALID_ARGUMENT" in bad_err and "sampling.max_tokens" in bad_err


def test_generate_without_a_server_fails_clearly():
    code, _, err = asyncio.run(run_cli("hi", "--server", "127.0.0.1:1", "--timeout", "5"))
    assert code != 0
    assert "UNAVAILABLE" in err
