"""The soak run at CI size (specdec/bench/soak.py; a longer one: `python scripts/soak.py --requests N`): 250
mixed requests at concurrency 32 against `specdec serve -np 8` on SmolLM2-135M in fp32, on loopback."""

import pytest

from specdec.bench import soak


@pytest.mark.real
def test_soak_250_mixed_requests_at_concurrency_32(smollm_dir):
    report = soak.run(str(smollm_dir), requests=250, concurrency=32, parallel=8, minutes=5)  # bounded: none start later
    print(report.summary())
    assert report.sent == 250, report.summary()
    assert not report.problems, "\n".join(report.problems[:20])  # hangs, unexpected statuses, outputs != plain
    assert report.compared >= 100 and report.outcomes["disconnected"] and report.outcomes["400"], report.summary()
    assert report.rss_growth_mb < 64, report.summary()
