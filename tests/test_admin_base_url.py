"""An operator pastes the base URL their clients use (`http://HOST:PORT/v1`) as an admin command's
`--url`: the command says to drop `/v1`, exits 2 and sends nothing. Sent, the proxy would pass the
unknown `/v1/admin/...` path (and the admin token with it) to the route's upstream, whose error
(a 502, a 404) says nothing of the mistake."""

from __future__ import annotations

import pytest

from tests.fixtures.servers import canned_upstream, proxy_config, write_yaml


def run(capsys, args: list[str]) -> tuple[int, str]:
    from modelcanary.compose import main

    capsys.readouterr()
    code = main(args)
    return code, capsys.readouterr().err


@pytest.mark.parametrize("command", [["status"], ["report", "support-bot"], ["promote", "support-bot"],
                                     ["rollback", "support-bot"], ["capture", "--out", "{out}", "--config", "{config}"]])
@pytest.mark.parametrize("suffix", ["/v1", "/v1/"])
def test_an_openai_base_url_as_admin_url_is_refused_with_the_root_to_give(capsys, tmp_path, command, suffix):
    config = write_yaml(tmp_path / "c.yaml", proxy_config("http://127.0.0.1:9"))
    args = [a.format(out=tmp_path / "golden.jsonl", config=config) for a in command]
    with canned_upstream(b'{"error": {"message": "upstream sim: could not connect", "type": "x"}}') as (root, seen):
        code, err = run(capsys, [*args, "--url", root + suffix, "--token", "sekrit"])
    assert err.strip() == f"error: --url: {root + suffix!r} ends in /v1, the base URL of OpenAI clients; the admin " \
                          f"API is at the proxy's root: give {root}"
    assert seen == [], "the admin token went to a /v1 path the proxy passes upstream"
    assert code == 2
