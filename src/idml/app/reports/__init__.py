"""Run reports: an offline HTML page with training curves, test metrics and the papers' figures.

* :mod:`idml.app.reports.runs` — read a run folder (:func:`read_run`) and analyse its checkpoint on the
  test split (:func:`analyse_run`, any run: its task's analysis, :meth:`idml.app.tasks.Task.analyse`).
* :mod:`idml.app.reports.classification` — the test-set analysis of a classification run.
* :mod:`idml.app.reports.figures` — the Matplotlib figures.
* :mod:`idml.app.reports.page` — :func:`write_report`, the page itself (``idml report``).
"""

from idml.app.reports.page import RunReport, write_report
from idml.app.reports.runs import AnalysisOptions, RunLog, TestAnalysis, analyse_run, read_run

__all__ = [
    "AnalysisOptions",
    "RunLog",
    "RunReport",
    "TestAnalysis",
    "analyse_run",
    "read_run",
    "write_report",
]
