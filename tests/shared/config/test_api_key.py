"""Where the gateway's API key comes from: --api-key, else --api-key-file, else
PDMESH_API_KEY, else vLLM's VLLM_API_KEY (the last three keep it out of `ps`)."""

from __future__ import annotations

import pytest

from pdmesh.shared.config.command_line import parse_command_line
from pdmesh.shared.config.serve import api_key


def flags(*words: str):
    return parse_command_line("gateway", ["--model", "m", *words])


def test_the_order_of_the_sources(tmp_path):
    f = tmp_path / "key"
    f.write_text("from-file\nsecond line ignored\n")
    env = {"PDMESH_API_KEY": "from-pdmesh-env", "VLLM_API_KEY": "from-vllm-env"}
    assert api_key(flags("--api-key", "flag", "--api-key-file", str(f)), env) == "flag"
    assert api_key(flags("--api-key-file", str(f)), env) == "from-file"
    assert api_key(flags(), env) == "from-pdmesh-env"
    assert api_key(flags(), {"VLLM_API_KEY": "from-vllm-env"}) == "from-vllm-env"
    assert api_key(flags(), {"PDMESH_API_KEY": ""}) is None
    assert api_key(flags(), {}) is None


@pytest.mark.parametrize(("content", "needle"), [(None, "cannot read"), ("\n", "is empty")])
def test_a_bad_key_file_names_the_flag(tmp_path, content, needle):
    f = tmp_path / "key"
    if content is not None:
        f.write_text(content)
    with pytest.raises(ValueError, match=f"^--api-key-file: .*{needle}"):
        api_key(flags("--api-key-file", str(f)), {})
