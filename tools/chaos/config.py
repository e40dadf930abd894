"""ChaosConfig: everything `pdserve bench chaos` runs with; its fields are the command's flags.

The time bounds are derived from the deployment's lease: a worker heartbeats every
`heartbeat_interval` seconds and the registry expires it after HEARTBEAT_MAX_FAILURE missed beats, so
one lease bound (`lease_bound_s`) after a fault every part of the system can know about it. A request
is **hung** when it has no answer `hung_after` seconds after the later of its start and that moment.
Freezes and network cuts last longer than lease + hung bound, so a request that waits for the frozen
worker to come back is seen as hung rather than rescued by the thaw.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from libkv.transfer import BACKEND_NAMES as BACKENDS
from pdserve import envs

REGISTRY_STORES = ("memory", "etcd")
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str, flag: str) -> float:
    """Seconds in "90", "90s", "30m", "1.5h"; a ValueError naming `flag` for anything else or <= 0."""
    raw = text.strip().lower()
    number, unit = (raw[:-1], raw[-1]) if raw[-1:] in _UNITS else (raw, "s")
    try:
        seconds = float(number) * _UNITS[unit]
    except ValueError:
        raise ValueError(f"{flag}: {text!r} is not a duration (e.g. 90s, 30m, 1h)") from None
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"{flag}: the duration must be > 0 and finite, got {text!r}")
    return seconds


def _help(text: str) -> dict:
    return {"help": text}


@dataclass(frozen=True)
class ChaosConfig:
    """Flags of `pdserve bench chaos`. Lists are comma-separated strings (flags are scalars)."""

    model_path: str = field(default=".cache/models/tiny", metadata=_help("checkpoint every worker serves"))
    backends: str = field(default="mooncake,nixl", metadata=_help(
        f"comma-separated transfer backends, one deployment each ({', '.join(BACKENDS)})"))
    scenarios: str = field(default="all", metadata=_help(
        "comma-separated scenarios to run, in this order, or 'all' (see --list-scenarios)"))
    duration: float = field(default=12.0, metadata=_help(
        "seconds of steady load around each fault: a third before it, the rest after it ends"))
    clients: int = field(default=6, metadata=_help("steady-load clients; half stream, half do not"))
    disconnects: int = field(default=120, metadata=_help("client disconnects in the disconnect scenario"))
    max_tokens: int = field(default=32, metadata=_help(
        "tokens each steady-load request generates (ignore_eos)"))
    hung_after: float = field(default=15.0, metadata=_help(
        "seconds after the later of its start and fault + lease bound with no answer: the request is hung"))
    hung_wait: float = field(default=20.0, metadata=_help(
        "seconds a hung request is still watched, to report whether (and when) it was answered late"))
    settle: float = field(default=45.0, metadata=_help(
        "seconds to wait for KV pages in use to return to idle before calling them leaked (longer than "
        "the 30 s transfer timeout, after which quarantined pages are freed)"))
    freeze: float = field(default=0.0, metadata=_help(
        "seconds a worker stays SIGSTOPped; 0 = lease bound + hung bound + 2"))
    network_cut: float = field(default=0.0, metadata=_help(
        "seconds a worker's network stays cut; 0 = lease bound + hung bound + 2"))
    registry_down: float = field(default=20.0, metadata=_help(
        "seconds the registry stays down when restarted (long enough for gRPC reconnect backoff to grow)"))
    idle: float = field(default=45.0, metadata=_help(
        "seconds of no traffic in the idle scenario (gRPC's default ping policy cuts idle channels after "
        "three 10 s keepalive pings)"))
    registry_store: str = field(default="memory", metadata=_help(
        "where the registry keeps its workers: memory, or etcd (a single-member etcd started with the "
        "deployment; the etcd-restart scenario always runs on one, in a deployment of its own)"))
    etcd_down: float = field(default=5.0, metadata=_help(
        "seconds etcd stays down each time the etcd-restart scenario kills it"))
    heartbeat_interval: float = field(default=1.0, metadata=_help(
        "workers' heartbeat interval (PDSERVE_DISAGGREGATION_HEARTBEAT_INTERVAL in every child)"))
    prefill_policy: str = field(default="round_robin", metadata=_help(
        "gateway policy for prefill workers: round_robin spreads the load over every worker, so every "
        "fault meets requests in flight and the recovery check reaches every worker"))
    decode_policy: str = field(default="random", metadata=_help(
        "gateway policy for decode workers: chosen independently of the prefill, so that all four "
        "(prefill, decode) pairs carry load (two round-robins advance in lockstep: two pairs only)"))
    num_pages: int = field(default=512, metadata=_help("KV pages per worker"))
    ready_timeout: float = field(default=180.0, metadata=_help("seconds a process may take to come up"))
    recovery_timeout: float = field(default=60.0, metadata=_help(
        "seconds for every worker to be seen by the gateway and serve a request after a scenario"))
    log_dir: str | None = field(default=None, metadata=_help(
        "one log file per process here (kept); unset = a temporary folder, kept only if a row fails"))
    seed: int = field(default=0, metadata=_help(
        "seed of the prompt set, the disconnect points and the soak's faults"))
    soak: str = field(default="", metadata=_help(
        "soak mode: one deployment per backend under steady load for this long (90s, 30m, 1h; bare "
        "numbers are seconds), faults drawn at random (--seed) from --scenarios one at a time; one "
        "summary row per backend. Empty: one row per scenario"))
    soak_gap: float = field(default=5.0, metadata=_help(
        "soak mode: the most seconds of plain load between two faults (each gap is drawn from half that "
        "to all of it)"))

    def __post_init__(self) -> None:
        for backend in self.backend_list:
            if backend not in BACKENDS:
                raise ValueError(f"--backends: unknown backend {backend!r}; choose from {BACKENDS}")
        if self.registry_store not in REGISTRY_STORES:
            raise ValueError(f"--registry-store: unknown store {self.registry_store!r}; "
                             f"choose from {REGISTRY_STORES}")
        if self.clients < 1:
            raise ValueError("--clients must be >= 1")
        if self.duration <= 0 or self.hung_after <= 0:
            raise ValueError("--duration and --hung-after must be > 0")
        if self.soak:
            parse_duration(self.soak, "--soak")  # a clear error at start, not after the deployment is up
        if self.soak_gap <= 0:
            raise ValueError("--soak-gap must be > 0")

    @property
    def backend_list(self) -> list[str]:
        return [b.strip() for b in self.backends.split(",") if b.strip()]

    @property
    def lease_bound_s(self) -> float:
        """Seconds after which the registry has expired the lease of a worker that stopped beating."""
        return self.heartbeat_interval * (envs.HEARTBEAT_MAX_FAILURE.get() + 1)

    @property
    def freeze_s(self) -> float:
        return self.freeze or self.lease_bound_s + self.hung_after + 2

    @property
    def network_cut_s(self) -> float:
        return self.network_cut or self.lease_bound_s + self.hung_after + 2

    @property
    def soak_s(self) -> float:
        """The soak's duration in seconds; 0 when not soaking."""
        return parse_duration(self.soak, "--soak") if self.soak else 0.0

    def fault_bound_s(self, scenario: str) -> float:
        """The longest one fault of `scenario` may take, repair included: its own outage (a freeze, a
        cut, the registry down, an idle spell), plus a restart's readiness wait and, after a gateway
        restart, the health probe. A fault that overruns it is reported and its task cancelled."""
        outage = {"freeze-prefill": self.freeze_s, "freeze-decode": self.freeze_s,
                  "network-cut-prefill": self.network_cut_s, "network-cut-decode": self.network_cut_s,
                  "registry-restart": self.registry_down,
                  "idle": self.idle + self.hung_after + self.hung_wait,
                  "idle-cut": self.idle + self.hung_after + self.hung_wait,
                  # etcd down twice (on its data, then wiped), the workers re-registering after each
                  "etcd-restart": 2 * (self.etcd_down + self.recovery_timeout),
                  # the store's master dead, then frozen (3 s each), the workers back on it after each
                  "kill-store-master": 6 + self.recovery_timeout}
        clients_leaving = self.disconnects * self.hung_after / 4  # disconnects: 4 at a time, each bounded
        return (outage.get(scenario, 0.0) + self.ready_timeout + self.recovery_timeout + self.hung_after
                + (clients_leaving if scenario in ("disconnects", "abort-window") else 0.0))

    @property
    def log_path(self) -> Path | None:
        return Path(self.log_dir) if self.log_dir else None
