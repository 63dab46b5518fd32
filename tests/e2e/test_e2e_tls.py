"""TLS through the real Envoy (components/gateway-tls and components/picker-tls, as overlays/a10 has
them; the local stack makes a throw-away CA at start): the official OpenAI client verifies the chain
on both listeners, plain HTTP and a client trusting another CA fail, and Envoy verifies the picker's
certificate: a picker serving one the CA did not sign is refused, so 8081 answers 503 and the
picker decides nothing."""

from __future__ import annotations

import asyncio
import ssl

import openai
import pytest

from local.certs import new_ca, write_run_certs
from tests.e2e.conftest import envoy_stats, envoy_upstream_requests, picker_decisions, start_stack

pytestmark = pytest.mark.e2e
LISTENERS = ("http", "llm-gw")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = start_stack(tmp_path_factory.mktemp("tls"), "tls", groups=2, tls=True)
    yield s
    s.stop()


def port(stack, listener: str) -> int:
    return stack.http_port if listener == "http" else stack.llm_port


def client(stack, listener: str, scheme: str = "https", verify=None) -> openai.OpenAI:
    """The official OpenAI client, verifying the listener's chain against `verify` (a CA file)."""
    verify = ssl.create_default_context(cafile=verify or str(stack.config.certs_dir / "ca.crt"))
    return openai.OpenAI(base_url=f"{scheme}://localhost:{port(stack, listener)}/v1", api_key=stack.api_key("user"),
                         max_retries=0, timeout=20, http_client=openai.DefaultHttpxClient(verify=verify))


@pytest.mark.parametrize("listener", LISTENERS)
def test_the_openai_client_verifies_the_chain(stack, listener):
    with client(stack, listener) as c:
        answer = c.completions.create(model="qwq", prompt="Say hello", max_tokens=4)
        assert answer.usage.completion_tokens == 4
        chat = c.chat.completions.create(model="qwq", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                         stream=True, stream_options={"include_usage": True})
        assert [e.usage.completion_tokens for e in chat if e.usage] == [3]


@pytest.mark.parametrize("listener", LISTENERS)
def test_plain_http_fails(stack, listener):
    with client(stack, listener, scheme="http") as c:
        with pytest.raises(openai.APIConnectionError):
            c.completions.create(model="qwq", prompt="Say hello", max_tokens=4)


@pytest.mark.parametrize("listener", LISTENERS)
def test_a_client_trusting_another_ca_fails(stack, listener, tmp_path):
    from cryptography.hazmat.primitives import serialization
    _, other = new_ca("another CA")
    path = tmp_path / "other-ca.crt"
    path.write_bytes(other.public_bytes(serialization.Encoding.PEM))
    with client(stack, listener, verify=str(path)) as c:
        with pytest.raises(openai.APIConnectionError) as caught:
            c.completions.create(model="qwq", prompt="Say hello", max_tokens=4)
    assert "CERTIFICATE_VERIFY_FAILED" in repr(caught.value.__cause__) or "certificate verify failed" in repr(
        caught.value.__cause__).lower(), repr(caught.value.__cause__)


async def test_envoy_verifies_the_picker_certificate(stack, tmp_path):
    """A picker whose certificate the run's CA did not sign (another CA, same names) is refused by
    Envoy: 8081 answers 503 and the picker decides nothing; with the right one again, it routes."""

    verified = await _ext_proc_tls(stack)
    assert verified["ssl.handshake"] >= 1, verified  # the 8081 requests above went over verified TLS
    good = {f: (stack.config.certs_dir / "picker" / f).read_bytes() for f in ("tls.crt", "tls.key")}
    impostor = write_run_certs(tmp_path / "impostor")  # a new CA signs the same names
    try:
        for f in ("tls.crt", "tls.key"):
            (stack.config.certs_dir / "picker" / f).write_bytes((impostor.picker / f).read_bytes())
        stack.stop_process("picker")
        stack.restart_process("picker")
        decisions = len(picker_decisions(stack))
        with client(stack, "llm-gw") as c:
            with pytest.raises(openai.APIStatusError) as refused:
                c.completions.create(model="qwq", prompt="Say hello", max_tokens=4)
        assert refused.value.status_code == 503
        after = await _ext_proc_tls(stack)
        assert after["ssl.fail_verify_error"] > verified["ssl.fail_verify_error"], after
        await asyncio.sleep(0.3)
        assert len(picker_decisions(stack)) == decisions
    finally:
        for f, data in good.items():
            (stack.config.certs_dir / "picker" / f).write_bytes(data)
        stack.stop_process("picker")
        stack.restart_process("picker")
    with client(stack, "llm-gw") as c:
        assert c.completions.create(model="qwq", prompt="Say hello", max_tokens=4).usage.completion_tokens == 4


async def _ext_proc_tls(stack) -> dict[str, int]:
    """Envoy's TLS counters of the picker's cluster (the ext_proc Backend)."""
    import aiohttp

    async with aiohttp.ClientSession() as session:
        stats = await envoy_stats(session, stack, "cluster.")
    picker = [name for name in stats if "extproc" in name and name.endswith(".ssl.handshake")]
    assert len(picker) == 1, sorted(n for n in stats if "extproc" in n)[:20]
    prefix = picker[0].removesuffix("ssl.handshake")
    return {k: stats.get(prefix + k, 0) for k in ("ssl.handshake", "ssl.fail_verify_error", "ssl.connection_error")}


async def test_a_deleted_api_key_secret_fails_closed(stack):
    """The key Secret removed from a running Gateway (as if nobody had created it): Envoy Gateway marks
    the SecurityPolicy invalid and Envoy answers 500 on both listeners, for every key, and no request
    reaches a backend. (This stack has no components/token-budget, so on 8081 the picker still decides:
    its ext_proc filter runs before the route's direct 500. overlays/a10 has the budget, whose filter
    refuses those requests before the picker: test_e2e_token_budget.py.) With the Secret back, the
    same key works again."""
    import aiohttp

    from local import dataplane
    import yaml

    path = stack.layout.resources / "gateway.yaml"
    original = path.read_text()
    docs = [d for d in yaml.safe_load_all(original) if d]
    kept = [d for d in docs if not (d["kind"] == "Secret" and d["metadata"]["name"] == "inference-gateway-api-keys")]
    assert len(kept) == len(docs) - 1
    context = ssl.create_default_context(cafile=str(stack.config.certs_dir / "ca.crt"))
    headers = {"Authorization": f"Bearer {stack.api_key('user')}"}
    body = {"model": "qwq", "prompt": "Say hello", "max_tokens": 4}

    async def statuses(session) -> list[int]:
        out = []
        for listener in LISTENERS:
            async with session.post(f"https://localhost:{port(stack, listener)}/v1/completions", json=body,
                                    headers=headers, ssl=context) as r:
                out.append(r.status)
        return out

    async with aiohttp.ClientSession() as session:
        assert await statuses(session) == [200, 200]
        try:
            dataplane.write_atomically(path, dataplane.dump(kept))
            deadline = asyncio.get_running_loop().time() + 30
            while (found := await statuses(session)) != [500, 500]:
                assert set(found) <= {200, 500} and asyncio.get_running_loop().time() < deadline, found
                await asyncio.sleep(0.2)
            await asyncio.sleep(1.0)  # the change has arrived everywhere
            upstream = await envoy_upstream_requests(session, stack)
            for _ in range(10):
                assert await statuses(session) == [500, 500]
            await asyncio.sleep(0.5)
            assert await envoy_upstream_requests(session, stack) == upstream  # no backend saw them
        finally:
            dataplane.write_atomically(path, original)
        deadline = asyncio.get_running_loop().time() + 30
        while await statuses(session) != [200, 200]:
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.2)
