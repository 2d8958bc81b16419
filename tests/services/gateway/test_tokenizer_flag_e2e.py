"""--tokenizer (SGLang's --tokenizer-path): a model folder without a tokenizer, served
with the tokenizer from another folder - the gateway tokenizes and renders chats with
it, the engine compiles a request's grammar against it."""

from __future__ import annotations

import httpx

from pdmesh.shared.infra.launcher import Service
from tests.mesh import stop_all

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def test_a_tokenizer_from_another_folder_serves_chats_and_grammars(qwen3_path, tmp_path,
                                                                  registry_prefix):
    model, tok = tmp_path / "model", tmp_path / "tokenizer"
    model.mkdir()
    tok.mkdir()
    for f in qwen3_path.iterdir():
        (tok if f.name in TOKENIZER_FILES else model).joinpath(f.name).symlink_to(f)
    assert (tok / "tokenizer.json").exists() and not (model / "tokenizer.json").exists()
    logs = tmp_path / "logs"
    logs.mkdir()
    reg = ["--registry-prefix", registry_prefix + "-tok"]
    started: list[Service] = []
    try:
        started.append(Service("mixed", [
            "mixed", "--model", str(model), "--tokenizer", str(tok),
            "--served-model-name", "tiny", "--device", "cpu", "--dtype", "float32",
            "--block-size", "16", *reg], logs))
        gw = Service("gateway", ["gateway", "--model", str(model), "--tokenizer-path",
                                 str(tok), "--port", "0", "--served-model-name", "tiny",
                                 *reg], logs)
        started.append(gw)
        base = gw.info["http"]
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Say yes or no."}],
                "max_tokens": 8, "temperature": 0, "guided_choice": ["yes", "no"]}
        r = httpx.post(base + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] in ("yes", "no"), r.json()
        t = httpx.post(base + "/tokenize", json={"model": "tiny", "prompt": "hello world"},
                       timeout=30)
        assert t.status_code == 200 and t.json()["tokens"], t.text
    finally:
        stop_all(started)
