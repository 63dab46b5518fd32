"""The whole service from its command line: static discovery, scraping, health, ext_proc, /metrics."""
import asyncio
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from picker.app import App
from picker.config import parse_args

from tests.helpers import extproc_client as c
from helpers import FakeVllm, body, free_ports, until

OBJECTIVES = """\
apiVersion: llm-d.ai/v1alpha2
kind: InferenceObjective
metadata: {name: batch}
spec: {priority: -1, poolRef: {name: reasoning-pool}}
"""


def test_cli_validation(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--discovery", "static"])
    with pytest.raises(SystemExit):
        parse_args(["--discovery", "static", "--endpoints", "nohost"])
    with pytest.raises(SystemExit):
        parse_args(["--discovery", "kubernetes", "--endpoints", "1.2.3.4:5"])
    a = parse_args(["--discovery", "kubernetes", "--pool-name", "p", "--no-secure-serving"])
    assert (a.grpc_port, a.health_port, a.metrics_port, a.secure_serving) == (9002, 9003, 9090, False)
    assert a.profile == "default" and a.scrape_interval == 0.1


@pytest.mark.parametrize("secure", [True, False])
async def test_static_service_end_to_end(tmp_path, secure):
    vllm = await FakeVllm().start()
    (tmp_path / "objectives.yaml").write_text(OBJECTIVES)
    metrics_port, = free_ports(1)
    args = parse_args(["--grpc-port", "0", "--health-port", "0", "--metrics-port", str(metrics_port),
                       "--outcomes-port", "0", "--bind", "127.0.0.1", "--discovery", "static", "--endpoints", vllm.address,
                       "--objects", str(tmp_path), "--scrape-interval", "0.05",
                       "--profile", "upstream-default"]
                      + ([] if secure else ["--no-secure-serving"]))
    app = App(args)
    await app.start()
    maintain = asyncio.create_task(app.maintain())
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.servers.health_port}") as hch:
            health = health_pb2_grpc.HealthStub(hch)

            async def status():
                r = await health.Check(health_pb2.HealthCheckRequest(
                    service="envoy.service.ext_proc.v3.ExternalProcessor"))
                return r.status

            for _ in range(200):
                if await status() == health_pb2.HealthCheckResponse.SERVING:
                    break
                await asyncio.sleep(0.02)
            assert await status() == health_pb2.HealthCheckResponse.SERVING
        await until(lambda: app.router.ready)
        ch = c.channel(app.servers.grpc_port, app.servers.certificate)
        _, answers = await c.send_full_duplex(c.ep_stub(ch), c.post_headers(), body())
        assert c.set_headers(answers[0].request_headers.response)["x-gateway-destination-endpoint"] == vllm.address
        await ch.close()
        assert app.router.objectives["batch"].priority == -1
        page = await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode())
        assert f'picker_endpoint_queue{{endpoint="{vllm.address}"}} 2.0' in page
        assert 'picker_requests_total{code="200",model="qwq",target_model="qwq"} 1.0' in page
    finally:
        app.request_stop()
        await maintain
        await app.stop()
        await vllm.stop()
