"""The lab's timeline: a step still running when the duration ends runs to its end before the teardown
deletes a pod (a traffic check's before/after counter reads never straddle a delete), and the report's
notes say the steps overran; each check's record says when it ran. Memory mode: no root."""

from __future__ import annotations

import random
import time
from pathlib import Path

from podmeter.lab import scenario as sc
from podmeter.lab.kube import pod_path
from podmeter.lab.run import LabOptions, LabRun
from podmeter.lab.scenario import parse_scenario

OVERRUN = """
name: step-past-the-duration
seed: 5
datapath: memory
duration: 2
settle: 1
node: {pod_cidr: 10.244.9.0/28}
operator: {enabled: false}
namespaces: [{name: web}]
steps:
  - {at: 0, do: pods, namespace: web, count: 2}
  - {at: 1, do: traffic, namespace: web, protocol: udp, pairs: 1, packets: 5}
  - {at: 1.5, do: delete, namespace: web, count: 1}
"""


class SlowTraffic(LabRun):
    """A traffic step that takes 2.5 s (an exchange waiting for its flow drains does), recording which of
    its pods exist at its start and at its end."""

    def traffic(self, step: sc.Traffic, pods: list[tuple[str, str]], rng: random.Random) -> None:
        assert self.client is not None
        client = self.client

        def existing() -> list[str]:
            return [f"{ns}/{name}" for ns, name in pods if client.get(pod_path(ns, name)) is not None]

        def probe() -> dict[str, object]:
            before = existing()
            time.sleep(2.5)
            return {"kind": "probe", "before": before, "after": existing()}

        self._timed(probe)


def test_a_step_in_flight_at_the_duration_ends_before_the_teardown_deletes_its_pods(tmp_path: Path) -> None:
    result = SlowTraffic(parse_scenario(OVERRUN), LabOptions(tmp_path, progress=False)).run()
    assert result.error is None, result.error
    [probe] = result.traffic
    assert len(probe["before"]) == 2 and probe["after"] == probe["before"], probe
    start, end = probe["at_s"]  # when it ran, on the samples' clock
    assert 1 <= start < 1.5 and end - start >= 2.5, probe
    assert result.counts["pods_deleted"] == 2  # the teardown's: no step started after the duration
    assert result.steps_s is not None and result.steps_s >= 3.4
    assert any("the step 1s traffic ran until" in note and "past the 2 s of steps" in note
               for note in result.notes), result.notes
    assert result.passed, result.failures
