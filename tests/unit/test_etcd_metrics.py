"""The etcd hygiene and fencing metrics read what the HA loop counts."""

from __future__ import annotations

import math
import re
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from lumend.cluster.agent import AgentTiming, ClusterAgent, NodeIdentity
from lumend.cluster.keys import Keys
from lumend.cluster.store import NOSPACE, EtcdStore
from lumend.metrics import DEPRECATED_NAMES, EtcdHygieneCollector, NodeCollector


def test_hygiene_metrics_expose_the_agents_counters() -> None:
    me = NodeIdentity(name="n1", address="a", gateway="g", rpc="r", checkpoint="c", metrics="m")
    agent = ClusterAgent(EtcdStore(["http://127.0.0.1:1"]), Keys("m"), me,
                         AgentTiming.for_ttl(10))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EtcdHygieneCollector(agent))
    text = generate_latest(registry).decode()
    assert "lumen_etcd_db_size_bytes" not in text  # never read: absent, not 0
    assert 'lumen_etcd_alarm{alarm="NOSPACE"}' not in text
    agent.heartbeat_writes, agent.compacted_revision, agent.trim_failures = 9, 1234, 2
    agent.store_status_db_bytes = 5 << 20
    agent.alarms = (NOSPACE,)
    agent.fence.unknown_refused = 3
    text = generate_latest(registry).decode()
    for line in ("lumen_heartbeat_writes_total 9.0", "lumen_etcd_compacted_revision 1234.0",
                 "lumen_events_trim_failures_total 2.0", "lumen_etcd_db_size_bytes 5.24288e+06",
                 'lumen_etcd_alarm{alarm="NOSPACE"} 1.0',
                 "lumen_agent_unknown_epoch_refused_total 3.0",
                 "lumen_etcd_compaction_failures_total 0.0",
                 "lumen_lease_renewals_total 0.0", "lumen_lease_renewal_lag_seconds 0.0",
                 "lumen_lease_seconds_since_renewal +Inf"):  # deprecated alias
        assert line in text, (line, text)
    agent.lease.renewals, agent.lease.max_gap_s = 5, agent.lease.interval_s + 0.75
    text = generate_latest(registry).decode()
    for line in ("lumen_lease_renewals_total 5.0", "lumen_lease_renewal_lag_seconds 0.75"):
        assert line in text, (line, text)


def test_a_renamed_metric_is_exported_under_both_names_and_documented() -> None:
    """lumen_lease_seconds_since_renewal is lumen_lease_renewal_age_seconds again, the unit
    not last: a deprecated alias with the same value, in the guide's table of renamed
    metrics (as is every name in DEPRECATED_NAMES)."""
    me = NodeIdentity(name="n1", address="a", gateway="g", rpc="r", checkpoint="c", metrics="m")
    agent = ClusterAgent(EtcdStore(["http://127.0.0.1:1"]), Keys("m"), me,
                         AgentTiming.for_ttl(10))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EtcdHygieneCollector(agent))
    registry.register(NodeCollector(agent, "n1", "m", workers=list, ready=lambda: True))
    families = {f.name: f for f in text_string_to_metric_families(
        generate_latest(registry).decode())}
    old = families["lumen_lease_seconds_since_renewal"]
    new = families["lumen_lease_renewal_age_seconds"]
    assert old.documentation == "Deprecated: use lumen_lease_renewal_age_seconds."
    assert old.samples[0].value == new.samples[0].value == math.inf  # no lease yet
    assert DEPRECATED_NAMES["lumen_lease_seconds_since_renewal"] == new.name
    for name, family in families.items():
        if family.documentation.startswith("Deprecated"):
            assert name in DEPRECATED_NAMES, name

    guide = (Path(__file__).parents[2] / "docs" / "operator-guide.md").read_text()
    table = guide[guide.index("| Old name (deprecated) | Name now |"):]
    rows = table[:table.index("\n\n")]
    for old_name, new_name in DEPRECATED_NAMES.items():
        assert re.search(rf"\| `{old_name}[{{`].*\| `{new_name}[{{`]", rows), old_name
