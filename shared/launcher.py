"""The cluster's services, described once: what each role runs and with which environment.

:func:`plan` turns a :class:`Topology` into one :class:`ServiceSpec` per
process. The local launcher (``baton up``, and the tests) starts exactly
these as processes with a real redis-server; ``docker-compose.yml`` runs the
same commands with the same environment (a test checks it against
:func:`compose_plan`), the only differences being addresses: under compose
each container advertises its own IP and every replica uses its role's
default port inside its own container.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path

from shared.cluster.auth import ClusterSecret, generate_secret
from shared.errors import ConfigError
from shared.ports import check_port_free
from shared.procs import RedisProcess, ServiceProcess

ROLE_MODULES = {
    "kvstore": "services.kvstore",
    "prefill": "services.prefill",
    "decode": "services.decode",
    "gateway": "services.gateway",
}
MIXED_MODULE = "services.mixed"
BALANCER_MODULE = "services.balancer"  # HAProxy before several gateways (local only)
DEFAULT_PORTS = {
    "gateway": 8000,
    "prefill": 8100,
    "decode": 8200,
    "kvstore": 8300,
    "colocated": 8400,
    "gateway-replica": 8500,  # with several gateways (the balancer takes "gateway")
}
KVSTORE_DATA_PORT = 8301
COMPOSE_REDIS_URL = "redis://redis:6379/0"


@dataclass(frozen=True)
class ServiceSpec:
    name: str  # e.g. "prefill-1"
    role: str
    env: dict[str, str]
    http_port: int
    mixed: bool = False  # a prefill or decode instance that also serves the other role

    @property
    def module(self) -> str:
        if self.mixed:
            return MIXED_MODULE
        if self.role == "balancer":
            return BALANCER_MODULE
        return ROLE_MODULES["decode" if self.role == "colocated" else self.role]

    def command(self, python: str = "python") -> list[str]:
        return [python, "-m", self.module]

    @property
    def ports(self) -> dict[str, int]:
        """What this service listens on (every interface), by what it serves there."""
        data = self.env.get("BATON_KVSTORE_DATA_PORT") if self.role == "kvstore" else None
        return {"HTTP": self.http_port, **({"data plane": int(data)} if data else {})}


PortFn = Callable[[str, int], int]  # (role, replica index) -> port


def base_ports(role: str, index: int) -> int:
    """Default ports; replicas of a role count up from its base (8100, 8101, ...)."""
    if role == "kvstore-data":
        return KVSTORE_DATA_PORT + 10 * index
    return DEFAULT_PORTS[role] + (10 * index if role == "kvstore" else index)


@dataclass(frozen=True)
class Topology:
    redis_url: str
    prefill: int = 1
    decode: int = 1
    kvstore: int = 1
    gateway_port: int = DEFAULT_PORTS["gateway"]
    advertise_host: str | None = "127.0.0.1"  # None: each service finds its own (compose)
    ports: PortFn = base_ports
    transport: str = "ucx"
    model: str | None = None
    dtype: str | None = None
    threads: int | None = 1  # per prefill/decode process
    # prefill and decode grow up to this many threads while other cores are idle (a
    # lone stream's steps, a prompt while decode waits), back to `threads` when the
    # other role or another process needs them
    max_threads: int | None = None
    kv_cache_gb: float | None = None  # per prefill/decode process
    kvstore_gb: float | None = None
    colocated: int = 0  # baseline engines serving both phases (the gateway then uses only them)
    # gateways: more than one run behind a balancer (HAProxy) on ``gateway_port``
    gateways: int = 1
    # every prefill and decode instance serves both roles (its own first; the gateway lends
    # it to the other role while that role's queue is over its bound)
    mixed: bool = False
    prefix_caching: bool = True  # False: no KV reuse anywhere (a baseline for caching)
    replication: int = 1  # KV store nodes each block is written to
    cpus: dict[str, str] = field(default_factory=dict)  # role -> CPU list, e.g. {"prefill": "0"}
    # role -> CPUs of the engine thread alone (the rest of the process stays on `cpus`)
    engine_cpus: dict[str, str] = field(default_factory=dict)
    extra_env: dict[str, str] = field(default_factory=dict)
    # what every internal call must present; None: the services run open (warned)
    cluster_secret: str | None = field(default_factory=generate_secret, repr=False)


def plan(topo: Topology) -> list[ServiceSpec]:
    common = {"BATON_REDIS_URL": topo.redis_url, "BATON_TRANSPORT": topo.transport}
    if topo.model:
        common["BATON_MODEL"] = topo.model
    if topo.dtype:
        common["BATON_DTYPE"] = topo.dtype
    if topo.cluster_secret:
        common["BATON_CLUSTER_SECRET"] = topo.cluster_secret
    if not topo.prefix_caching:
        common["BATON_ENABLE_PREFIX_CACHING"] = "false"
    if topo.replication > 1:
        if topo.kvstore < topo.replication:
            raise ValueError(f"{topo.replication} replicas need as many KV store nodes")
        common["BATON_REPLICATION"] = str(topo.replication)
    common.update(topo.extra_env)
    specs: list[ServiceSpec] = []

    def advertise(prefix: str) -> dict[str, str]:
        if topo.advertise_host is None:
            return {}
        return {f"BATON_{prefix}_ADVERTISE_HOST": topo.advertise_host}

    for i in range(topo.kvstore):
        http, data = topo.ports("kvstore", i), topo.ports("kvstore-data", i)
        env = {
            **common,
            "BATON_KVSTORE_HTTP_PORT": str(http),
            "BATON_KVSTORE_DATA_PORT": str(data),
            **advertise("KVSTORE"),
        }
        if topo.kvstore_gb:
            env["BATON_KVSTORE_CAPACITY_GB"] = repr(topo.kvstore_gb)
        if "kvstore" in topo.cpus:
            env["BATON_CPUS"] = topo.cpus["kvstore"]
        specs.append(ServiceSpec(f"kvstore-{i}", "kvstore", env, http))
    for role in ("prefill", "decode", "colocated"):
        for i in range(getattr(topo, role)):
            port = topo.ports(role, i)
            mixed = topo.mixed and role != "colocated"
            prefix = "MIXED" if mixed else "DECODE" if role == "colocated" else role.upper()
            env = {**common, f"BATON_{prefix}_PORT": str(port), **advertise(prefix)}
            if role == "colocated":
                env["BATON_DECODE_COLOCATED"] = "true"
            if mixed:
                env["BATON_MIXED_HOME"] = role
            if role in topo.cpus:
                env["BATON_CPUS"] = topo.cpus[role]
            if role in topo.engine_cpus:
                env["BATON_ENGINE_CPUS"] = topo.engine_cpus[role]
            if topo.threads:
                env["BATON_NUM_THREADS"] = str(topo.threads)
            if topo.max_threads and role in ("prefill", "decode"):
                env["BATON_MAX_THREADS"] = str(topo.max_threads)
            if topo.kv_cache_gb:
                env["BATON_KV_CACHE_GB"] = repr(topo.kv_cache_gb)
            specs.append(ServiceSpec(f"{role}-{i}", role, env, port, mixed=mixed))
    gateway_env = dict(common)
    if topo.colocated:
        gateway_env["BATON_GATEWAY_MODE"] = "colocated"
    if "gateway" in topo.cpus:
        gateway_env["BATON_CPUS"] = topo.cpus["gateway"]
    if topo.gateways <= 1:
        env = {**gateway_env, "BATON_GATEWAY_PORT": str(topo.gateway_port)}
        specs.append(ServiceSpec("gateway", "gateway", env, topo.gateway_port))
        return specs
    backends = []
    for i in range(topo.gateways):
        port = topo.ports("gateway-replica", i)
        env = {**gateway_env, "BATON_GATEWAY_PORT": str(port)}
        specs.append(ServiceSpec(f"gateway-{i}", "gateway", env, port))
        backends.append(f"127.0.0.1:{port}")
    balancer = {
        "BATON_BALANCER_PORT": str(topo.gateway_port),
        "BATON_BALANCER_BACKENDS": ",".join(backends),
    }
    specs.append(ServiceSpec("balancer", "balancer", balancer, topo.gateway_port))
    return specs


# compose's one-shot `secret` service leaves the cluster secret in this file of a volume
# every other service mounts read-only (`baton secret`): `docker compose up` as typed
COMPOSE_SECRET_FILE = "/run/baton/secret/cluster-secret"
# Kubernetes sets BATON_CLUSTER_SECRET from its Secret (deploy/k8s/secret.yaml)
KUBERNETES_SECRET = "valueFrom: secretKeyRef baton-cluster"


def container_plan(*, secret_file: str | None) -> list[ServiceSpec]:
    """What the containers run: one replica per role, container addresses, the cluster
    secret read from ``secret_file`` (compose) or, with None, set in the environment
    (Kubernetes, from its Secret).

    UCX between containers uses its TCP transport only: its cross-process memory
    transport (cma) needs ptrace rights that Docker's default profile withholds."""
    extra = {"UCX_TLS": "tcp"}
    if secret_file is not None:
        extra["BATON_CLUSTER_SECRET_FILE"] = secret_file
    return plan(
        Topology(
            redis_url=COMPOSE_REDIS_URL,
            advertise_host=None,
            transport="ucx",
            threads=None,
            extra_env=extra,
            cluster_secret=None if secret_file is not None else KUBERNETES_SECRET,
        )
    )


def compose_plan() -> list[ServiceSpec]:
    """What docker-compose.yml must run."""
    return container_plan(secret_file=COMPOSE_SECRET_FILE)


def kubernetes_plan() -> list[ServiceSpec]:
    """What deploy/k8s must run."""
    return container_plan(secret_file=None)


def check_ports(specs: list[ServiceSpec]) -> None:
    """Before anything loads a model: every port the plan listens on is free (TIME_WAIT
    left by a cluster just stopped counts as free) and planned once. Raises one
    :class:`ConfigError` line naming the instance and the port."""
    owners: dict[int, str] = {}
    for spec in specs:
        for what, port in spec.ports.items():
            if not port:
                continue
            if port in owners:
                raise ConfigError(
                    f"port {port} is planned twice: {owners[port]} and {spec.name} ({what})"
                )
            owners[port] = f"{spec.name} ({what})"
            try:
                check_port_free("0.0.0.0", port, what)
            except ConfigError as exc:
                raise ConfigError(f"{spec.name}: {exc}") from None


class LocalCluster:
    """Redis + the planned services as local processes; stop() tears down in reverse."""

    def __init__(
        self,
        topo_for: Callable[[str], Topology],
        *,
        redis_port: int | None = None,
        log_dir: Path | None = None,
        prefix_output: bool = False,
    ):
        self.redis = RedisProcess(redis_port)
        self.topo_for = topo_for
        self.log_dir = log_dir
        self.prefix_output = prefix_output
        self.procs: dict[str, ServiceProcess] = {}
        self.specs: list[ServiceSpec] = []

    @property
    def secret(self) -> ClusterSecret:
        """The secret the services were given (for tests and tools that call them)."""
        return ClusterSecret(self.specs[0].env.get("BATON_CLUSTER_SECRET") if self.specs else None)

    def secret_env(self) -> dict[str, str]:
        """The environment a further service joining this cluster needs."""
        value = self.secret.value
        return {"BATON_CLUSTER_SECRET": value} if value else {}

    @property
    def gateway_url(self) -> str:
        """Where clients go: the balancer in front of several gateways, else the one."""
        front = next(s for s in self.specs if s.role in ("balancer", "gateway"))
        front = next((s for s in self.specs if s.role == "balancer"), front)
        return f"http://127.0.0.1:{front.http_port}"

    def start(self, timeout_s: float = 180.0) -> LocalCluster:
        try:
            self.redis.start()
            self.specs = plan(self.topo_for(self.redis.url))
            check_ports(self.specs)
            # all at once: each finds the others through Redis as they come (a gateway is
            # ready once every role has a live instance), so their imports and model loads
            # overlap instead of queueing behind the store's
            started = [self._start(s) for s in self.specs]
            for proc in started:
                proc.wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, spec: ServiceSpec) -> ServiceProcess:
        log = None if self.log_dir is None else self.log_dir / f"{spec.name}.log"
        proc = ServiceProcess(
            spec.module,
            spec.env,
            f"http://127.0.0.1:{spec.http_port}/ready",
            log,
            prefix=spec.name if self.prefix_output else None,
            name=spec.name,
        )
        self.procs[spec.name] = proc.start()
        return proc

    def pids(self, roles: Collection[str]) -> list[int]:
        """Process ids of the running services of ``roles`` (``"redis"`` for Redis)."""
        pids = [self.pid_of(s) for s in self.specs if s.role in roles]
        if "redis" in roles and self.redis.proc is not None and self.redis.proc.poll() is None:
            pids.append(self.redis.proc.pid)
        return [p for p in pids if p is not None]

    def pid_of(self, spec: ServiceSpec) -> int | None:
        """The process id of one service while it runs."""
        service = self.procs.get(spec.name)
        proc = service.proc if service is not None else None
        return proc.pid if proc is not None and proc.poll() is None else None

    def add(self, spec: ServiceSpec, timeout_s: float = 180.0) -> ServiceProcess:
        """Start one more service (a new replica) into the running cluster."""
        self.specs.append(spec)
        return self._start(spec).wait_ready(timeout_s)

    def stop(self) -> None:
        order = ["balancer", "gateway", "colocated", "decode", "prefill", "kvstore"]
        for role in order:
            for spec in self.specs:
                proc = self.procs.get(spec.name)
                if spec.role == role and proc is not None:
                    proc.stop()
        self.redis.stop()
