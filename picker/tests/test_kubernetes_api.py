"""Kubernetes discovery through the real `kubernetes` client against a fake API server on
127.0.0.1: list, watch streams, a 410 Gone event answered by a relist, pods turning ready."""
import asyncio
import json
import threading

from aiohttp import web

from picker.discovery.kubernetes import PoolState, api_watches, start_threads

from test_kubernetes_discovery import POOL, pod

PATHS = {
    "pool": "/apis/inference.networking.k8s.io/v1/namespaces/default/inferencepools",
    "pods": "/api/v1/namespaces/default/pods",
    "objectives": "/apis/llm-d.ai/v1alpha2/namespaces/default/inferenceobjectives",
    "rewrites": "/apis/llm-d.ai/v1alpha2/namespaces/default/inferencemodelrewrites",
}
OBJECTIVE = {"apiVersion": "llm-d.ai/v1alpha2", "kind": "InferenceObjective",
             "metadata": {"name": "batch", "resourceVersion": "3"},
             "spec": {"priority": -1, "poolRef": {"name": "reasoning-pool"}}}


class FakeApiServer:
    def __init__(self, watch_gate=lambda: True):
        # the pod watch holds its events until watch_gate() is true, so that the state listed
        # first is published before the events change it, however the threads are scheduled
        self.watch_gate = watch_gate
        # per path: the list answers (in order; the last repeats) and the watch scripts
        self.lists = {
            "pool": [([POOL], "1")],
            "pods": [([pod("a", "10.1.0.1", rv="5")], "5"), ([pod("c", "10.1.0.3", rv="20")], "20")],
            "objectives": [([OBJECTIVE], "3")],
            "rewrites": [([], "1")],
        }
        self.watches = {k: [] for k in PATHS}
        self.watches["pods"] = [
            [{"type": "ADDED", "object": pod("b", "10.1.0.2", ready=False, rv="6")},
             {"type": "MODIFIED", "object": pod("b", "10.1.0.2", ready=True, rv="7")}],
            [{"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1", "code": 410,
                                          "reason": "Expired", "message": "too old resource version"}}],
            [{"type": "DELETED", "object": pod("c", "10.1.0.3", rv="21")}],
        ]
        self.requests: list[tuple[str, str]] = []

    async def handle(self, request: web.Request):
        kind = next(k for k, p in PATHS.items() if p == request.path)
        watching = request.query.get("watch", "").lower() in ("true", "1")
        self.requests.append((kind, "watch" if watching else "list"))
        if not watching:
            answers = self.lists[kind]
            items, rv = answers.pop(0) if len(answers) > 1 else answers[0]
            return web.json_response({"kind": "List", "apiVersion": "v1", "metadata": {"resourceVersion": rv},
                                      "items": items})
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        while not self.watch_gate():
            await asyncio.sleep(0.01)
        script = self.watches[kind].pop(0) if self.watches[kind] else []
        for event in script:
            await resp.write(json.dumps(event).encode() + b"\n")
        if not script:
            await asyncio.sleep(0.2)  # an idle watch that times out
        await resp.write_eof()
        return resp

    async def start(self):
        app = web.Application()
        for p in PATHS.values():
            app.router.add_get(p, self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        return self


async def test_watches_against_fake_api_server(tmp_path, monkeypatch):
    published = []
    api = await FakeApiServer(watch_gate=lambda: any(p[0] == ["10.1.0.1:8000"] for p in published)).start()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(f"""\
apiVersion: v1
kind: Config
clusters: [{{name: fake, cluster: {{server: "http://127.0.0.1:{api.port}"}}}}]
users: [{{name: fake, user: {{token: test}}}}]
contexts: [{{name: fake, context: {{cluster: fake, user: fake, namespace: default}}}}]
current-context: fake
""")
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    state = PoolState("reasoning-pool", lambda eps, objs, rws: published.append((eps, objs)))
    stop = threading.Event()
    threads = start_threads(api_watches(state, "default", timeout_seconds=5), stop)
    try:
        loop = asyncio.get_running_loop()
        end = loop.time() + 20
        def done():
            return (state.is_synced and api.requests.count(("pods", "list")) == 2
                    and not api.watches["pods"] and published and published[-1][0] == [])

        while not done():
            assert loop.time() < end, f"never converged: {published[-3:]}"
            await asyncio.sleep(0.05)
        endpoints_seen = [p[0] for p in published]
        assert ["10.1.0.1:8000"] in endpoints_seen
        assert ["10.1.0.1:8000", "10.1.0.2:8000"] in endpoints_seen     # b became ready
        assert ["10.1.0.3:8000"] in endpoints_seen                      # relist after 410: a, b gone
        assert endpoints_seen[-1] == []                                 # c deleted by the next watch
        assert [o.name for o in published[-1][1]] == ["batch"]
    finally:
        stop.set()
        await asyncio.sleep(0.3)
        await api.runner.cleanup()
        for t in threads:
            t.join(timeout=5)
