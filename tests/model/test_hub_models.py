"""Models by hub id (org/name): resolved through huggingface_hub from a hub cache the test lays
out on disk (HF_HUB_OFFLINE: no network), at a branch, tag or commit; named by their id, also
when a snapshot directory is given by path. A model missing offline is refused clearly."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hub_cache import add_snapshot
from reference import hf_greedy
from transformers import AutoModelForCausalLM, LlamaConfig

from tandem import LLM, SamplingParams
from tandem.model.loader import load_hf_model
from tandem.model.source import resolve_model_source

REPO = "acme/tiny-llama"
COMMIT_A, COMMIT_B = "a" * 40, "b" * 40
CONFIG: dict[str, Any] = dict(
    vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.3, bos_token_id=1, eos_token_id=2,
    tie_word_embeddings=True)


@pytest.fixture(scope="module")
def hub(tmp_path_factory, tokenizer):
    """A hub cache with REPO at two commits (different weights): main -> A, branch v2 -> B."""
    cache = tmp_path_factory.mktemp("hub")
    for seed, commit, branch in ((0, COMMIT_A, "main"), (1, COMMIT_B, "v2")):
        files = tmp_path_factory.mktemp(f"files-{seed}")
        torch.manual_seed(seed)
        AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG)).save_pretrained(files)
        tokenizer.save_pretrained(files)
        add_snapshot(cache, REPO, files, commit, branch)
    return cache


@pytest.fixture
def offline(hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub


@pytest.mark.parametrize(("revision", "commit"), [(None, COMMIT_A), ("main", COMMIT_A), ("v2", COMMIT_B),
                                                  (COMMIT_B, COMMIT_B)])
def test_a_hub_id_resolves_to_its_snapshot(offline, revision, commit):
    source = resolve_model_source(REPO, revision)
    assert source.path.endswith(f"/snapshots/{commit}") and source.name == REPO and source.gguf_file is None


def test_a_snapshot_directory_is_named_by_its_repository(offline):
    snapshot = offline / "models--acme--tiny-llama" / "snapshots" / COMMIT_B
    assert resolve_model_source(str(snapshot)).name == REPO


def test_missing_offline_is_refused_naming_the_model(offline):
    with pytest.raises(FileNotFoundError, match="acme/absent.*HF_HUB_OFFLINE"):
        resolve_model_source("acme/absent")
    with pytest.raises(FileNotFoundError, match="tiny-llama.*'v9'.*HF_HUB_OFFLINE"):
        resolve_model_source(REPO, "v9")


def test_llm_by_hub_id_and_revision_matches_transformers_on_that_snapshot(offline):
    prompts = [list(range(200, 200 + n)) for n in (3, 20)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = {}
    for revision in (None, "v2"):
        llm = LLM(REPO, revision=revision, block_size=8, kv_cache_memory_gib=0.05)
        got[revision] = [o.token_ids for o in llm.generate(prompts, params)]
        hf_model, _ = load_hf_model(resolve_model_source(REPO, revision))
        assert got[revision] == [hf_greedy(hf_model, p, 8, eos_token_ids=(10**6,)) for p in prompts]
    assert got[None] != got["v2"]  # two snapshots, two models


def test_tandem_download_prints_the_snapshot(offline, capsys):
    """`tandem download` (the Helm chart's init step for a hub id) resolves as the workers do."""
    from tandem.cli import main

    assert main(["download", REPO, "--revision", "v2"]) == 0
    assert capsys.readouterr().out.strip().endswith(f"/snapshots/{COMMIT_B}")
    assert main(["download", "acme/absent"]) == 1
    assert "HF_HUB_OFFLINE" in capsys.readouterr().err


def test_tandem_download_refuses_what_is_not_a_hub_id(capsys):
    from tandem.cli import main

    assert main(["download", "/not/a/hub/id"]) == 2
    assert "is not a hub id" in capsys.readouterr().err
