import io
import logging
import sys


def test_servelab_logs_reach_the_stderr_of_the_moment(monkeypatch):
    from servelab.logs import log_to_stderr

    logger = logging.getLogger("servelab")
    saved = list(logger.handlers), logger.level, logger.propagate
    try:
        first = io.StringIO()
        monkeypatch.setattr(sys, "stderr", first)
        log_to_stderr("%(levelname)s %(message)s", "info", replace=True)
        first.close()  # as a test's capture closes its stream when the test ends
        second = io.StringIO()
        monkeypatch.setattr(sys, "stderr", second)
        logging.getLogger("servelab.cluster").error("worker %d is gone", 3)
        assert second.getvalue() == "ERROR worker 3 is gone\n"
    finally:
        logger.handlers[:], logger.level, logger.propagate = saved
