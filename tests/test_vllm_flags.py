"""vLLM's command lines work: `tandem serve MODEL` with vLLM's flag names and meanings, the same
flags from a --config YAML file and from TANDEM_<FLAG> variables (the command line over both),
and LLM(...) with vLLM's keywords."""

from __future__ import annotations

import pytest

from tandem import cli
from tandem.config import WorkerConfig
from tandem.config.engine_options import from_vllm_keywords
from tandem.router import serve_command
from tandem.router.auth import DEFAULT_TENANT, api_keys_from_env


@pytest.fixture(autouse=True)
def no_tandem_env(monkeypatch):
    import os

    for name in [n for n in os.environ if n.startswith("TANDEM_")]:
        monkeypatch.delenv(name)


def serve(*argv: str):
    return cli.parse_args(["serve", *argv])


def test_the_model_is_positional_as_in_vllm_serve():
    args = serve("Qwen/Qwen2.5-0.5B-Instruct", "--revision", "v1", "--served-model-name", "qwen", "q")
    assert serve_command.worker_config(args) == WorkerConfig(model="Qwen/Qwen2.5-0.5B-Instruct", revision="v1")
    assert args.served_model_name == ["qwen", "q"]
    assert serve_command.worker_config(serve("--model", "/m")).model == "/m"
    assert serve_command.worker_config(serve("/m", "--model", "/m")).model == "/m"
    with pytest.raises(ValueError, match="two models given"):
        serve_command.worker_config(serve("/m", "--model", "/n"))


def test_vllm_engine_flags_reach_every_worker():
    args = serve("--swap-space", "2", "--no-enable-prefix-caching", "--seed", "7", "--max-num-seqs", "8",
                 "--max-model-len", "512", "--gpu-memory-utilization", "0.5", "--enforce-eager")
    assert serve_command.worker_config(args).engine == {"swap_space_gib": 2.0, "enable_prefix_caching": False,
                                                        "seed": 7, "max_num_seqs": 8, "max_model_len": 512,
                                                        "gpu_memory_utilization": 0.5, "enforce_eager": True}


@pytest.mark.parametrize(("argv", "tp"), [((), (1, 1)), (("-tp", "2"), (2, 2)),
                                          (("--tensor-parallel-size", "4"), (4, 4)),
                                          (("-tp", "2", "--decode-tp", "1"), (2, 1))])
def test_tensor_parallel_size_is_both_pools_unless_one_says_otherwise(argv, tp):
    args = serve(*argv)
    assert serve_command.pool_tp(args) == tp
    assert "tensor_parallel_size" not in serve_command.worker_config(args).engine  # the cluster sets it per pool


def test_api_key_is_the_default_tenants():
    keys = api_keys_from_env(serve("--api-key", "k1").api_key)
    assert keys is not None and keys.tenants == {"k1": DEFAULT_TENANT}


def test_chat_template_from_a_file_or_inline(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert serve_command.read_chat_template(str(path)) == "{{ messages[0]['content'] }}"
    assert serve_command.read_chat_template("{{ 'x' }}") == "{{ 'x' }}"
    with pytest.raises(ValueError, match="--chat-template: cannot read 'nope.jinja'"):
        serve_command.read_chat_template("nope.jinja")


def test_config_file_then_environment_then_command_line(tmp_path, monkeypatch):
    config = tmp_path / "serve.yaml"
    config.write_text("max-num-seqs: 32\nblock_size: 8\nenable-prefix-caching: false\nserved-model-name: [a, b]\n"
                      "kv-cache-memory-gib: 0.25\n")
    args = serve("--config", str(config))
    assert (args.max_num_seqs, args.block_size, args.enable_prefix_caching, args.served_model_name,
            args.kv_cache_memory_gib) == (32, 8, False, ["a", "b"], 0.25)
    monkeypatch.setenv("TANDEM_MAX_NUM_SEQS", "16")
    monkeypatch.setenv("TANDEM_ENABLE_PREFIX_CACHING", "true")
    monkeypatch.setenv("TANDEM_COLOCATED", "2")
    args = serve("--config", str(config))
    assert (args.max_num_seqs, args.block_size, args.enable_prefix_caching, args.colocated) == (16, 8, True, 2)
    args = serve("--config", str(config), "--max-num-seqs", "4", "--no-enable-prefix-caching")
    assert (args.max_num_seqs, args.enable_prefix_caching) == (4, False)
    # chat takes the engine options the same way
    assert cli.parse_args(["chat"]).max_num_seqs == 16


@pytest.mark.parametrize(("text", "error"), [("no-such-flag: 1\n", "no flag --no-such-flag"),
                                             ("dtype: float8\n", "'float8' is not one of"),
                                             ("max-num-seqs: many\n", "'many'"),
                                             ("- a list\n", "must map flags to values")])
def test_a_bad_config_file_is_refused_naming_the_flag(tmp_path, capsys, text, error):
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    with pytest.raises(SystemExit):
        serve("--config", str(config))
    assert error in capsys.readouterr().err


def test_a_bad_environment_value_is_refused_naming_the_variable(monkeypatch, capsys):
    monkeypatch.setenv("TANDEM_ENABLE_PREFIX_CACHING", "maybe")
    with pytest.raises(SystemExit):
        serve()
    assert "TANDEM_ENABLE_PREFIX_CACHING: 'maybe' is not a boolean" in capsys.readouterr().err


def test_llm_takes_vllms_keywords():
    assert from_vllm_keywords({"swap_space": 2, "enforce_eager": True, "max_num_seqs": 4,
                               "disable_log_stats": True}) == {
        "swap_space_gib": 2, "enforce_eager": True, "max_num_seqs": 4}
    with pytest.raises(ValueError, match="swap_space and swap_space_gib name the same option"):
        from_vllm_keywords({"swap_space_gib": 1, "swap_space": 2})
