"""The etcd key schema (DESIGN.md section 4). Every key LUMEN writes is built here."""

from __future__ import annotations

from dataclasses import dataclass

INTENT_KINDS = ("drain", "failover")


@dataclass(frozen=True)
class Keys:
    cluster: str

    @property
    def root(self) -> str:
        return f"/lumen/{self.cluster}/"

    @property
    def nodes(self) -> str:
        return self.root + "nodes/"

    @property
    def workers(self) -> str:
        return self.root + "workers/"

    @property
    def intents(self) -> str:
        return self.root + "intents/"

    @property
    def events(self) -> str:
        return self.root + "events/"

    @property
    def assists(self) -> str:
        return self.root + "assist/"

    def assist(self, recovering_worker: str) -> str:
        return self.assists + recovering_worker

    @property
    def recoveries(self) -> str:
        return self.root + "recovery/"

    def recovery(self, failed_worker: str) -> str:
        return self.recoveries + failed_worker

    @property
    def coordinator(self) -> str:
        return self.root + "coordinator"

    @property
    def coordinator_status(self) -> str:
        return self.root + "coordinator_status"

    @property
    def config(self) -> str:
        return self.root + "config"

    @property
    def assist_estimates(self) -> str:
        return self.root + "assist_estimates"

    def node(self, name: str) -> str:
        return self.nodes + name

    def worker(self, name: str) -> str:
        return self.workers + name

    def intent(self, kind: str, target: str) -> str:
        if kind not in INTENT_KINDS:
            raise ValueError(f"unknown intent kind {kind!r}; expected one of {INTENT_KINDS}")
        return f"{self.intents}{kind}/{target}"

    def event(self, at_ms: int, source: str, seq: int) -> str:
        # Zero-padded milliseconds first, so keys sort by time (etcd ranges sort by key).
        return f"{self.events}{at_ms:013d}-{source}-{seq:04d}"
