"""Run reports: an offline HTML page with training curves, test metrics and the papers' figures.

* :mod:`idml.app.reports.runs` — read a run folder (:func:`read_run`) and analyse its checkpoint on the
  test split (:func:`analyse_run`, any run).
* :mod:`idml.app.reports.classification` — the test-set analysis of a classification run
  (:func:`analyse_classification_run`, which :func:`analyse_run` calls for one).
* :mod:`idml.app.reports.figures` — the Matplotlib figures.
* :mod:`idml.app.reports.page` — :func:`write_report`, the page itself (``idml report``).
"""

from idml.app.reports.classification import ClassificationAnalysis, analyse_classification_run
from idml.app.reports.page import RunReport, write_report
from idml.app.reports.runs import AnalysisOptions, RunLog, TestAnalysis, analyse_run, read_run

__all__ = [
    "AnalysisOptions",
    "ClassificationAnalysis",
    "RunLog",
    "RunReport",
    "TestAnalysis",
    "analyse_classification_run",
    "analyse_run",
    "read_run",
    "write_report",
]
