"""A kubelet and the workload controllers for tests (issue 18): runs the Pods of the StatefulSets, Deployments and
Jobs in the kmock API emulator as processes on this machine.

Each pod gets its own 127.0.0.x address and its own mount namespace (tests/helpers/podns.py): its volumes at
their mountPaths, Service names in its /etc/hosts. In a real pod 0.0.0.0 means the pod's own interfaces; here
pods share the machine's network, so a container is told to listen on its pod address instead (`--host` or
`--status-host` appended to its args, which win over its config file). Readiness comes from the pod's probe (gRPC
health or HTTP); pod and workload status are written back through the API, where the operator reads them; a container
that exits is started again per its restartPolicy and its termination message is reported.

Claims are directories under workdir/claims, one per PersistentVolumeClaim, which must exist in the API (a
StatefulSet's volumeClaimTemplates create theirs); pods are placed on `nodes` nodes in turn, and a ReadWriteOnce
claim in use on one node keeps a pod on another Pending with the kubelet's Multi-Attach error.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from glm5_operator.kube import PLURALS, Kube, Ref
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.helpers.periodic import cancel, every
from tests.helpers.podspec import (
    LWS_KEY,
    LWS_NAME,
    Objects,
    PodError,
    deployment_pods,
    job_pods,
    launch,
    leader_worker_set_pods,
    leader_worker_set_service,
    statefulset_claims,
    statefulset_pods,
    write_volumes,
)

log = logging.getLogger(__name__)
# the kinds the controllers emulated here write, which the operator's own client never needs
PLURALS.update({"Job": "jobs", "PersistentVolumeClaim": "persistentvolumeclaims"})
ROOT = Path(__file__).resolve().parents[2]
# the programs that listen, and their flag for the address to listen on
LISTEN_FLAG = {"worker": "--host", "router": "--host", "tito-gateway": "--host", "trainer": "--status-host"}


@dataclass
class RunningPod:
    manifest: dict[str, Any]
    ip: str
    dir: Path
    node: str = "node-0"
    finished: bool = False  # every container exited and its restartPolicy starts none again (Jobs)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    restarts: dict[str, int] = field(default_factory=dict)
    ready: bool = False
    message: str = ""  # why it is not running (an error of the runner's, shown as the pod's status)
    terminated: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return str(self.manifest["metadata"]["name"])


class PodRunner:
    def __init__(
        self, emulator: Any, kube: Kube, namespace: str, workdir: Path, nodes: int = 1,
        devices: dict[str, int] | None = None, programs: dict[str, list[str]] | None = None,
    ) -> None:  # fmt: skip
        """`nodes`: pods are placed on node-0 .. node-{nodes-1} in turn (ReadWriteOnce claims attach to one).
        `devices`: extended resources each node offers (say huawei.com/Ascend910: 8); a pod asking for more, or
        for one no node has, stays Pending. `programs`: container name -> the program run instead of the image's
        (with the container's arguments),
        for containers that cannot run here (an NPU worker); it runs in the pod as the container would."""
        self.emulator, self.kube, self.ns, self.workdir, self.nodes = emulator, kube, namespace, workdir, nodes
        self.devices, self.programs = devices or {}, programs or {}
        self.pods: dict[str, RunningPod] = {}
        self._next_ip = 2
        self._task: asyncio.Task[None] | None = None
        self._terminating: set[asyncio.Future[None]] = set()
        self._launched: list[tuple[str, subprocess.Popen[bytes]]] = []  # every container process, for stop()
        self.restarted_groups: list[str] = []  # pods a LeaderWorkerSet group restart recreated

    # -- lifecycle ------------------------------------------------------------------------------------

    async def start(self, interval: float = 0.3) -> None:
        self._task = every(interval, self.sync, "pod runner")

    async def stop(self) -> None:
        await cancel(self._task)
        for pod in self.pods.values():
            self._kill(pod)
        await asyncio.gather(*self._terminating)
        for pod, proc in self._launched:  # a process the runner lost track of must not outlive the test
            if proc.poll() is None:
                log.warning("pod %s's process %d outlived the pod runner: killed", pod, proc.pid)
                proc.kill()
                proc.wait()

    def kill(self, pod: str, container: str | None = None) -> None:
        """SIGKILL a container's process, as an OOM kill or a node problem would (its restartPolicy applies)."""
        running = self.pods[pod]
        running.procs[container or next(iter(running.procs))].kill()

    def describe(self) -> str:
        """Each pod's state and the tail of its containers' logs (for a test's failure message)."""
        out = []
        for pod in self.pods.values():
            logs = " | ".join(
                f"{c.name}: " + " / ".join(c.read_text(errors="replace").strip().splitlines()[-3:])
                for c in sorted(pod.dir.glob("*.log"))
            )  # fmt: skip
            state = _phase(pod) + (" ready" if pod.ready else "") + (f" ({pod.message})" if pod.message else "")
            out.append(f"\n  {pod.name} on {pod.node}: {state}; restarts {sum(pod.restarts.values())}; {logs}")
        return "".join(out) or "none"

    def address(self, service: str) -> str:
        """Where a Service's traffic goes: its first ready pod (no kube-proxy here)."""
        ips = self._service_ips().get(service, [])
        if not ips:
            raise LookupError(f"service {service} has no ready pod")
        return ips[0]

    # -- one pass -------------------------------------------------------------------------------------

    def _objects(self, resource: str) -> list[dict[str, Any]]:
        return [dict(o.raw) for (res, ns, _), o in list(self.emulator.objects.items())
                if res == resource and ns == self.ns and not o.deleted]  # fmt: skip

    async def sync(self) -> None:
        wanted: dict[str, dict[str, Any]] = {}
        for sts in self._objects("apps/v1/statefulsets"):
            wanted |= {p["metadata"]["name"]: p for p in statefulset_pods(sts)}
        for dep in self._objects("apps/v1/deployments"):
            wanted |= {p["metadata"]["name"]: p for p in deployment_pods(dep)}
        for job in self._objects("batch/v1/jobs"):
            wanted |= {p["metadata"]["name"]: p for p in job_pods(job)}
        for lws in self._objects("leaderworkerset.x-k8s.io/v1/leaderworkersets"):
            wanted |= {p["metadata"]["name"]: p for p in leader_worker_set_pods(lws)}
            await asyncio.to_thread(self._ensure, leader_worker_set_service(lws))
            if lws["spec"]["leaderWorkerTemplate"].get("restartPolicy") == "RecreateGroupOnPodRestart":
                await self._recreate_broken_groups(lws["metadata"]["name"])
        await asyncio.to_thread(self._create_claims)
        for name in set(self.pods) - set(wanted):  # scaled down or deleted: out of DNS at once, then stopped
            pod = self.pods.pop(name)
            # its stop is a task from here on, with no await between: a runner stopped meanwhile (a test that saw
            # the pod go ends at once) still waits for it, where a pass cancelled at an await before the task
            # existed left the pod's process running after the suite (seen: an RLJob's TITO gateway)
            task = asyncio.create_task(asyncio.to_thread(self._remove, pod))
            self._terminating.add(task)
            task.add_done_callback(self._terminating.discard)
        for name, manifest in wanted.items():
            pod = self.pods.get(name)
            if pod is None or pod.manifest["spec"] != manifest["spec"] or _hash(pod) != _hash_of(manifest):
                if pod is not None:
                    self._kill(pod)
                node = f"node-{(self._next_ip - 2) % self.nodes}"
                pod = self.pods[name] = RunningPod(manifest, f"127.0.0.{self._next_ip}", self.workdir / name, node)
                self._next_ip += 1
                await asyncio.to_thread(self._create_pod_object, manifest)
            self._write_hosts(pod)
            if pod.procs:
                self._refresh_volumes(pod)
            if not pod.procs and not pod.finished and not pod.terminated:
                self._start(pod)  # again every pass until it starts: a claim or ConfigMap may appear meanwhile
            self._restart_exited(pod)
            pod.ready = await self._probe(pod)
            await asyncio.to_thread(self._write_pod_status, pod)
        await asyncio.to_thread(self._write_workload_status)

    # -- LeaderWorkerSets -----------------------------------------------------------------------------

    def _ensure(self, manifest: dict[str, Any]) -> None:
        if self.kube.get(Ref.of(manifest)) is None:
            self.kube.create(manifest)

    async def _recreate_broken_groups(self, lws: str) -> None:
        """RecreateGroupOnPodRestart: a group one of whose containers exited is deleted whole (the next pass creates
        it again), as the controller does, so a replica's ranks always start together."""
        groups: dict[str, list[str]] = {}
        for name, pod in self.pods.items():
            labels = pod.manifest["metadata"]["labels"]
            if labels.get(LWS_NAME) == lws:
                groups.setdefault(labels[LWS_KEY], []).append(name)
        for members in groups.values():
            broken = [m for m in members if sum(self.pods[m].restarts.values())
                      or any(p.poll() is not None for p in self.pods[m].procs.values())]  # fmt: skip
            if broken:
                log.info("LeaderWorkerSet %s: a pod of group %s restarted: recreating %s", lws, members[0], members)
                for name in members:
                    pod = self.pods.pop(name)
                    await asyncio.to_thread(self._kill, pod, 5.0)
                    await asyncio.to_thread(self.kube.delete, Ref("v1", "Pod", self.ns, name))
                    self.restarted_groups.append(name)

    # -- pods -----------------------------------------------------------------------------------------

    def _create_pod_object(self, manifest: dict[str, Any]) -> None:
        with contextlib.suppress(Exception):
            self.kube.delete(Ref("v1", "Pod", self.ns, manifest["metadata"]["name"]))
        self.kube.create(manifest)

    def _create_claims(self) -> None:
        """The StatefulSet controller's part: a claim per pod and volumeClaimTemplate, kept on scale-down."""
        have = {c["metadata"]["name"] for c in self._objects("v1/persistentvolumeclaims")}
        for sts in self._objects("apps/v1/statefulsets"):
            for claim in statefulset_claims(sts):
                if claim["metadata"]["name"] not in have:
                    with contextlib.suppress(Exception):
                        self.kube.create(claim)

    def _claims_problem(self, pod: RunningPod) -> str:
        """Why the pod's claims cannot be attached on its node ('' when they can), in the kubelet's words."""
        claims = {c["metadata"]["name"]: c for c in self._objects("v1/persistentvolumeclaims")}
        for volume in pod.manifest["spec"].get("volumes") or []:
            if "persistentVolumeClaim" not in volume:
                continue
            name = volume["persistentVolumeClaim"]["claimName"]
            if name not in claims:
                return f'persistentvolumeclaim "{name}" not found'
            modes = set(claims[name]["spec"].get("accessModes") or ["ReadWriteOnce"])
            if modes & {"ReadWriteMany", "ReadOnlyMany"}:
                continue
            users = [other for other in self.pods.values() if other is not pod and other.procs
                     and name in _claims_of(other)]  # fmt: skip
            elsewhere = [u.name for u in users if u.node != pod.node or "ReadWriteOncePod" in modes]
            if elsewhere:
                return (f'Multi-Attach error for volume "{name}": Volume is already used by pod(s) '
                        f"{', '.join(elsewhere)}")  # fmt: skip
        return ""

    def _start(self, pod: RunningPod) -> None:
        spec = pod.manifest["spec"]
        for container in spec["containers"]:
            limits = (container.get("resources") or {}).get("limits") or {}
            wanted = [r for r, n in limits.items() if "/" in r and int(n) > self.devices.get(r, 0)]
            if wanted:
                pod.message = f"0/{self.nodes} nodes are available: insufficient {', '.join(wanted)}"
                return
        pod.message = self._claims_problem(pod)
        if pod.message:
            return
        objects = self._api_objects()
        try:
            volumes = write_volumes(pod.manifest, objects, pod.dir, self.workdir / "claims")
            for container in spec["containers"]:
                self._launch(pod, container, launch(pod.manifest, container, objects, volumes, pod.ip))
        except PodError as exc:
            pod.message = str(exc)

    def _launch(self, pod: RunningPod, container: dict[str, Any], run: Any) -> None:
        name = container["name"]
        args = run.argv
        if name in self.programs:  # given the container's arguments (after the image's `glm5`)
            args = [sys.executable, *self.programs[name], *run.argv[3:]]
        elif len(args) > 3 and args[3] in LISTEN_FLAG:
            args = [*args, LISTEN_FLAG[args[3]], pod.ip]  # this pod's address stands for its network namespace
        message_path = container.get("terminationMessagePath")
        mounts = list(run.mounts)
        if message_path:
            message_file = pod.dir / f"{name}.termination-log"
            message_file.write_text("")
            mounts.append({"source": str(message_file), "target": message_path, "file": True})
        env = {**_base_env(), **run.env}
        spec_file = pod.dir / f"{name}.json"
        spec_file.write_text(json.dumps({"mounts": mounts, "hosts": str(pod.dir / "hosts"), "argv": args,
                                         "env": env, "cwd": "/tmp", "keep": [str(ROOT)]}))  # fmt: skip
        out = open(pod.dir / f"{name}.log", "ab")  # noqa: SIM115 - owned by the process
        pod.procs[name] = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", sys.executable, "-m", "tests.helpers.podns",
             str(spec_file)], stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, **env},
        )  # fmt: skip
        self._launched.append((pod.name, pod.procs[name]))

    def _refresh_volumes(self, pod: RunningPod) -> None:
        """ConfigMap and Secret volumes follow their objects, as the kubelet's periodic sync makes them (each file
        replaced whole, so a reader never sees half of one)."""
        with contextlib.suppress(PodError):
            write_volumes(pod.manifest, self._api_objects(), pod.dir, self.workdir / "claims", only_projected=True)

    def _api_objects(self) -> Objects:
        return Objects(
            config_maps={c["metadata"]["name"]: c for c in self._objects("v1/configmaps")},
            secrets={s["metadata"]["name"]: s for s in self._objects("v1/secrets")},
        )

    def _restart_exited(self, pod: RunningPod) -> None:
        policy = pod.manifest["spec"].get("restartPolicy", "Always")
        for container in pod.manifest["spec"]["containers"]:
            proc = pod.procs.get(container["name"])
            if proc is None or proc.poll() is None:
                continue
            message_file = pod.dir / f"{container['name']}.termination-log"
            message = message_file.read_text() if message_file.exists() else ""
            reason = "Completed" if proc.returncode == 0 else "Error"
            pod.terminated[container["name"]] = {"exitCode": proc.returncode, "message": message, "reason": reason}
            del pod.procs[container["name"]]
            if policy == "Never" or (policy == "OnFailure" and proc.returncode == 0):
                pod.finished = not pod.procs
                continue
            pod.restarts[container["name"]] = pod.restarts.get(container["name"], 0) + 1
            objects = self._api_objects()
            volumes = write_volumes(pod.manifest, objects, pod.dir, self.workdir / "claims")
            self._launch(pod, container, launch(pod.manifest, container, objects, volumes, pod.ip))

    async def _probe(self, pod: RunningPod) -> bool:
        if not pod.procs:
            return False
        for container in pod.manifest["spec"]["containers"]:
            probe = container.get("readinessProbe")
            if probe is None:
                continue
            if "grpc" in probe:
                try:
                    async with grpc.aio.insecure_channel(f"{pod.ip}:{probe['grpc']['port']}") as ch:
                        reply = await health_pb2_grpc.HealthStub(ch).Check(
                            health_pb2.HealthCheckRequest(service=probe["grpc"].get("service", "")), timeout=1
                        )
                    if reply.status != health_pb2.HealthCheckResponse.SERVING:
                        return False
                except grpc.aio.AioRpcError:
                    return False
            elif "httpGet" in probe:
                port = probe["httpGet"]["port"]
                named = {p.get("name"): p["containerPort"] for p in container.get("ports") or []}
                url = f"http://{pod.ip}:{named.get(port, port)}{probe['httpGet'].get('path', '/')}"
                try:
                    await asyncio.to_thread(urllib.request.urlopen, url, None, 1)
                except OSError:
                    return False
        return True

    def _write_pod_status(self, pod: RunningPod) -> None:
        statuses = []
        for c in pod.manifest["spec"]["containers"]:
            running = c["name"] in pod.procs
            state = {"running": {}} if running else {"waiting": {"reason": "Pending"}}
            if pod.finished:
                state = {"terminated": pod.terminated[c["name"]]}
            restarts = pod.restarts.get(c["name"], 0)
            status: dict[str, Any] = {"name": c["name"], "ready": pod.ready and running, "state": state,
                                      "restartCount": restarts, "image": c.get("image", "")}  # fmt: skip
            if c["name"] in pod.terminated and not pod.finished:
                status["lastState"] = {"terminated": pod.terminated[c["name"]]}
            statuses.append(status)
        body = {"status": {
            "phase": _phase(pod), "podIP": pod.ip, "hostIP": pod.node,
            "conditions": [{"type": "Ready", "status": "True" if pod.ready else "False",
                            **({"message": pod.message} if pod.message else {})}],
            "containerStatuses": statuses,
        }}  # fmt: skip
        with contextlib.suppress(Exception):
            self.kube.patch(Ref("v1", "Pod", self.ns, pod.name), body, "status")

    def _write_workload_status(self) -> None:
        for kind, resource, pods_of in (("StatefulSet", "apps/v1/statefulsets", statefulset_pods),
                                        ("Deployment", "apps/v1/deployments", deployment_pods)):  # fmt: skip
            for obj in self._objects(resource):
                names = [p["metadata"]["name"] for p in pods_of(obj)]
                ready = sum(1 for n in names if n in self.pods and self.pods[n].ready)
                status = {"replicas": len(names), "readyReplicas": ready, "availableReplicas": ready,
                          "updatedReplicas": len(names), "currentReplicas": len(names),
                          "observedGeneration": obj["metadata"].get("generation", 1)}  # fmt: skip
                if all((obj.get("status") or {}).get(k) == v for k, v in status.items()):
                    continue
                with contextlib.suppress(Exception):
                    self.kube.patch(Ref("apps/v1", kind, self.ns, obj["metadata"]["name"]), {"status": status},
                                    "status")  # fmt: skip

        for lws in self._objects("leaderworkerset.x-k8s.io/v1/leaderworkersets"):
            groups: dict[str, list[str]] = {}
            for p in leader_worker_set_pods(lws):
                groups.setdefault(p["metadata"]["labels"][LWS_KEY], []).append(p["metadata"]["name"])
            ready = sum(all(n in self.pods and self.pods[n].ready for n in names) for names in groups.values())
            lws_status = {"replicas": len(groups), "readyReplicas": ready, "updatedReplicas": len(groups),
                          "observedGeneration": lws["metadata"].get("generation", 1)}  # fmt: skip
            if any((lws.get("status") or {}).get(k) != v for k, v in lws_status.items()):
                with contextlib.suppress(Exception):
                    self.kube.patch(Ref("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet", self.ns,
                                        lws["metadata"]["name"]), {"status": lws_status}, "status")  # fmt: skip

        for job in self._objects("batch/v1/jobs"):
            pods = [self.pods.get(p["metadata"]["name"]) for p in job_pods(job)]
            phases = [_phase(p) if p is not None else "Pending" for p in pods]
            done = {"active": sum(ph in ("Pending", "Running") for ph in phases),
                    "succeeded": phases.count("Succeeded"), "failed": phases.count("Failed")}  # fmt: skip
            job_status: dict[str, Any] = dict(done)
            if done["succeeded"] or done["failed"]:
                kind = "Complete" if done["succeeded"] else "Failed"
                job_status["conditions"] = [{"type": kind, "status": "True"}]
            if all((job.get("status") or {}).get(k) == v for k, v in job_status.items()):
                continue
            with contextlib.suppress(Exception):
                self.kube.patch(Ref("batch/v1", "Job", self.ns, job["metadata"]["name"]), {"status": job_status},
                                "status")  # fmt: skip

    # -- names ----------------------------------------------------------------------------------------

    def _service_ips(self) -> dict[str, list[str]]:
        """Service name (every spelling) -> ready pod addresses; headless per-pod names too."""
        out: dict[str, list[str]] = {}
        for svc in self._objects("v1/services"):
            name, selector = svc["metadata"]["name"], (svc["spec"].get("selector") or {})
            headless = svc["spec"].get("clusterIP") == "None"
            publish = bool(svc["spec"].get("publishNotReadyAddresses"))
            ips = []
            for pod in self.pods.values():
                labels = pod.manifest["metadata"]["labels"]
                if not selector or any(labels.get(k) != v for k, v in selector.items()):
                    continue
                if pod.ready or publish:
                    ips.append(pod.ip)
                if headless and pod.manifest["spec"].get("subdomain") == name:
                    for spelling in _spellings(f"{pod.manifest['spec']['hostname']}.{name}", self.ns):
                        out.setdefault(spelling, []).append(pod.ip)
            for spelling in _spellings(name, self.ns):
                out.setdefault(spelling, []).extend(ips)
        return out

    def _write_hosts(self, pod: RunningPod) -> None:
        pod.dir.mkdir(parents=True, exist_ok=True)
        lines = ["127.0.0.1 localhost", f"{pod.ip} {pod.name}"]
        for name, ips in sorted(self._service_ips().items()):
            lines += [f"{ip} {name}" for ip in ips]
        text = "\n".join(lines) + "\n"
        hosts = pod.dir / "hosts"
        if not hosts.exists() or hosts.read_text() != text:
            with open(hosts, "a+") as f:  # in place: the pod's /etc/hosts is a bind mount of this inode
                f.seek(0)
                f.truncate()
                f.write(text)

    def _remove(self, pod: RunningPod) -> None:
        """A pod scaled down or deleted: its object deleted, its processes SIGTERMed, SIGKILLed after the grace."""
        self.kube.delete(Ref("v1", "Pod", self.ns, pod.name))
        self._kill(pod, float(pod.manifest["spec"].get("terminationGracePeriodSeconds", 30)))

    def _kill(self, pod: RunningPod, grace: float = 10.0) -> None:
        for proc in pod.procs.values():
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + grace
        for proc in pod.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.1, deadline - time.monotonic()))
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        pod.procs.clear()


def _phase(pod: RunningPod) -> str:
    if pod.finished:
        failed = any(t["exitCode"] != 0 for t in pod.terminated.values())
        return "Failed" if failed else "Succeeded"
    return "Running" if pod.procs else "Pending"


def _claims_of(pod: RunningPod) -> set[str]:
    return {v["persistentVolumeClaim"]["claimName"] for v in pod.manifest["spec"].get("volumes") or []
            if "persistentVolumeClaim" in v}  # fmt: skip


def _spellings(name: str, ns: str) -> list[str]:
    return [name, f"{name}.{ns}", f"{name}.{ns}.svc", f"{name}.{ns}.svc.cluster.local"]


def _base_env() -> dict[str, str]:
    # GLM5_ENFORCE_EAGER: the suite's workers run eagerly (tests/conftest.py), in pods too
    keep = ("PATH", "HOME", "LANG", "PYTHONPATH", "VIRTUAL_ENV", "GLM5_HOME", "GLM5_ENFORCE_EAGER")
    return {k: os.environ[k] for k in keep if k in os.environ} | {"PYTHONPATH": str(ROOT)}


def _hash(pod: RunningPod) -> str:
    return _hash_of(pod.manifest)


def _hash_of(manifest: dict[str, Any]) -> str:
    return str((manifest["metadata"].get("annotations") or {}).get("glm5.ai/config-hash", ""))
