"""Warnings and notices go through logging: one logger per package (abs, storage, recovery),
children per module, and a default handler that shows them on stderr as they were printed
before to who configures nothing."""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from abscore.logs import PACKAGES, DefaultHandler, package_logger


def run_python(code: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-c", code], env=dict(os.environ), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return done


LOG_EACH = (
    "import logging, abs, storage, recovery\n"
    "logging.getLogger('abs.runtime.cleanup').warning('gc failed (%s); files are kept', 'boom')\n"
    "logging.getLogger('storage.store').info('%s: a notice', 'root')\n"
    "logging.getLogger('recovery.choose').error('no checkpoint')\n"
    "logging.getLogger('abs').debug('not shown')\n"
)


def test_who_configures_nothing_sees_warnings_and_notices_on_stderr_as_printed_before():
    done = run_python(LOG_EACH)
    assert done.stdout == ""
    assert done.stderr.splitlines() == [
        "[abs] warning: gc failed (boom); files are kept",
        "root: a notice",
        "[recovery] error: no checkpoint",
    ]


def test_an_application_that_routes_logging_itself_sees_each_line_once():
    done = run_python(
        "import logging, sys\n"
        "logging.basicConfig(stream=sys.stdout, level=logging.INFO, format='%(levelname)s %(name)s %(message)s')\n"
        "import abscore.logs\n"
        "abscore.logs.remove_default_handlers()\n" + LOG_EACH.replace("import logging, ", "import ")
        + "import abs, storage, recovery\n"  # imported again: the handlers stay removed
        "logging.getLogger('storage').warning('once')\n"
    )
    assert done.stderr == ""
    assert done.stdout.splitlines() == [
        "WARNING abs.runtime.cleanup gc failed (boom); files are kept",
        "INFO storage.store root: a notice",
        "ERROR recovery.choose no checkpoint",
        "WARNING storage once",
    ]


def test_the_package_loggers_carry_one_default_handler_and_keep_a_level_set_on_them():
    import abs  # noqa: F401
    import recovery  # noqa: F401
    import storage  # noqa: F401

    for name in PACKAGES:
        logger = logging.getLogger(name)
        assert sum(isinstance(h, DefaultHandler) for h in logger.handlers) == 1
        assert package_logger(name) is logger  # idempotent: still one handler
        assert sum(isinstance(h, DefaultHandler) for h in logger.handlers) == 1
    logger = logging.getLogger("abs")
    before = logger.level
    try:
        logger.setLevel(logging.WARNING)
        package_logger("abs")
        assert logger.level == logging.WARNING
    finally:
        logger.setLevel(before)


def test_the_default_handler_writes_to_the_stderr_of_the_moment(capsys):
    import abs  # noqa: F401

    logging.getLogger("abs.test").warning("captured %d", 1)
    logging.getLogger("abs.test").info("a notice")
    assert capsys.readouterr().err.splitlines() == ["[abs] warning: captured 1", "a notice"]


def test_a_failing_background_gc_logs_its_warning_on_the_abs_logger(tmp_path, caplog, capsys):
    from abs.runtime.cleanup import BackgroundGc, GcRequest
    from storage import SnapshotStore

    store = SnapshotStore.open(str(tmp_path))
    store.init_job({"job_name": "j", "max_parallelism": 8})
    gc = BackgroundGc()
    with caplog.at_level(logging.WARNING, logger="abs"):
        gc.submit(GcRequest(store, 0, (), 2))  # retain 0 is refused by the store
        assert gc.drain(timeout=60)
    assert gc.close(timeout=60)
    records = [r for r in caplog.records if r.name == "abs.runtime.cleanup"]
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    assert records[0].getMessage().startswith("garbage collection after checkpoint 2 failed (")
    err = capsys.readouterr().err
    assert err.startswith("[abs] warning: garbage collection after checkpoint 2 failed (") and err.count("\n") == 1


@pytest.mark.parametrize("level, prefix", [(logging.WARNING, "[storage] warning: "), (logging.CRITICAL, "[storage] error: "),
                                           (logging.INFO, "")])
def test_the_default_format_names_the_package_of_a_warning(level, prefix):
    record = logging.LogRecord("storage.gc.sub", level, __file__, 1, "x %s", ("y",), None)
    assert DefaultHandler().format(record) == f"{prefix}x y"
