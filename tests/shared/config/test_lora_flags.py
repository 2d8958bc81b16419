"""The LoRA flags, vLLM's and SGLang's, into the engine's fields."""

from __future__ import annotations

import pytest

from pdmesh.shared.config.serve import serve_config


def check(*words: str):
    return serve_config("config check", ["--role", "decode", "--model", "/tmp/m",
                                         "--device", "cpu", *words])


def test_vllm_s_and_sglang_s_adapter_lists():
    e = check("--enable-lora", "--lora-modules", "sql=/a/sql",
              '{"name": "chat", "path": "/a/chat", "base_model_name": "m"}',
              "--lora-paths", "/a/plain", "x=/a/x", '{"lora_name": "y", "lora_path": "/a/y"}',
              "--max-loras", "3", "--max-lora-rank", "32", "--max-cpu-loras", "5").engine
    assert e.enable_lora and (e.max_loras, e.max_lora_rank, e.max_cpu_loras) == (3, 32, 5)
    assert e.lora_modules == (("sql", "/a/sql"), ("chat", "/a/chat"), ("/a/plain", "/a/plain"),
                              ("x", "/a/x"), ("y", "/a/y"))
    # SGLang's names for the same limits; its --lora-paths alone turns LoRA on
    e = check("--lora-paths", "a=/a", "--max-loras-per-batch", "4",
              "--max-loaded-loras", "6").engine
    assert e.enable_lora and (e.max_loras, e.max_cpu_loras) == (4, 6)
    assert not check().engine.enable_lora


@pytest.mark.parametrize(("words", "said"), [
    (["--lora-modules", "/a/sql"], "--lora-modules: '/a/sql': expected name=path"),
    (["--lora-modules", "a=/x", "a=/y"], "the adapter name 'a' is given twice"),
    (["--lora-modules", '{"name": "a"}'], "needs 'name' and 'path'"),
    (["--lora-paths", "{oops"], "--lora-paths: '{oops' is not JSON"),
    (["--enable-lora", "--max-loras", "2", "--max-cpu-loras", "1"], "max_cpu_loras"),
    (["--enable-lora", "-tp", "2"], "enable_lora: not with tensor_parallel_size"),
])
def test_bad_lora_lines_are_refused_naming_the_flag(words, said):
    with pytest.raises((ValueError, SystemExit)) as e:
        check(*words)
    assert said in str(e.value), str(e.value)


def test_what_has_no_effect_is_listed_to_be_said_at_start():
    cfg = check("--enable-lora", "--fully-sharded-loras", "--lora-eviction-policy", "fifo")
    assert set(cfg.accepted_without_effect) == {"--fully-sharded-loras",
                                                "--lora-eviction-policy"}
    assert check("--enable-lora").accepted_without_effect == ()
