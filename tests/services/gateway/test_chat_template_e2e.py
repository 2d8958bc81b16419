"""--chat-template (a file, or the template in one line, as vLLM reads it) replaces the
checkpoint's template at the gateway; a request's own chat_template renders only with
--trust-request-chat-template, and is refused with a 400 naming it otherwise."""

from __future__ import annotations

import httpx
import pytest

from pdmesh.shared.infra.launcher import Service
from pdmesh.shared.models.tokenizer import Tokenizer, load_chat_template
from tests.mesh import stop_all

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


def _tokens(url: str, **extra) -> httpx.Response:
    return httpx.post(url + "/tokenize", timeout=30,
                      json={"model": "tiny", "messages": MESSAGES, **extra})


def test_a_chat_template_flag_and_a_trusted_request_template(qwen3_path, tmp_path,
                                                             registry_prefix):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                        "{% if add_generation_prompt %}[assistant]{% endif %}")
    own = "{% for m in messages %}<{{ m.content }}>{% endfor %}"
    tok = Tokenizer(qwen3_path)
    reg = ["--registry-prefix", registry_prefix + "-tmpl"]
    started: list[Service] = []
    try:
        gateways = {}
        for name, extra in (("file", ["--chat-template", str(template)]),
                            ("literal", ["--chat-template", r"{{ messages[-1].content }}\n!",
                                         "--trust-request-chat-template"])):
            gw = Service("gateway", ["gateway", str(qwen3_path), "--port", "0",
                                     "--served-model-name", "tiny", *extra, *reg], tmp_path)
            started.append(gw)
            gateways[name] = gw.info["http"]
        r = _tokens(gateways["file"])
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == tok.encode(
            "[system] be brief\n[user] hi\n[assistant]", add_special_tokens=False)
        r = _tokens(gateways["literal"])  # the one-line form: its \\n is a newline
        assert r.json()["tokens"] == tok.encode("hi\n!", add_special_tokens=False)
        # a request's own template: refused unless trusted, by name
        r = _tokens(gateways["file"], chat_template=own)
        assert r.status_code == 400 and "--trust-request-chat-template" in r.text, r.text
        r = httpx.post(gateways["file"] + "/v1/chat/completions", timeout=30, json={
            "model": "tiny", "messages": MESSAGES, "max_tokens": 2,
            "chat_template_kwargs": {"chat_template": own}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text
        r = _tokens(gateways["literal"], chat_template=own)
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == tok.encode("<be brief><hi>", add_special_tokens=False)
    finally:
        stop_all(started)


def test_a_chat_template_path_that_cannot_be_read_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="--chat-template: .*looks like a file's path"):
        load_chat_template(str(tmp_path / "missing.jinja"))
