"""The IDML study behind ``benchmarks/study_idml.py``, which describes it and is its entry point (the
CLI), one module an idea:

- :mod:`idml_study.design`: the settings, methods, arms, degradations, comparisons, and the knobs
  and recipe candidates ``validate`` chooses among;
- :mod:`idml_study.recipes`: what a folder's runs train with, and the pins that keep them on one
  set (layout, ``--override`` values, the validated recipe);
- :mod:`idml_study.ledger`: the committed copy of a folder's pins and finished runs' records;
- :mod:`idml_study.results`: a grid's finished runs as read back, and their means;
- :mod:`idml_study.mechanism`: ``mechanism.json`` and the controls matched to it;
- :mod:`idml_study.jobs`: running jobs, and the grid ``run`` trains;
- :mod:`idml_study.tables`: the ``tables`` command and the pieces of every table;
- :mod:`idml_study.choose`: ``validate``, ``converge`` and ``widen``, which choose the recipes.
- :mod:`idml_study.summary`: the README's table of every cell, read from the committed tables.

Each module imports only from the modules above it in this list, and none imports the script.
"""
