"""The application layer of idml: what runs the library.

Typed configs (:mod:`idml.app.config`) and what builds a run from them (:mod:`idml.app.build`), the
trainer (:mod:`idml.app.training`) and its multi-process form (:mod:`idml.app.distributed`),
checkpoints and run folders, inference and retrieval over a trained run (:mod:`idml.app.inference`,
:mod:`idml.app.retrieval`), ablations, reports and the command line (:mod:`idml.app.cli`).

Dependencies point one way: these modules import the library (``idml.relations``,
``idml.embeddings``, ``idml.metrics``, ``idml.losses``, ``idml.miners``, ``idml.augment``,
``idml.ranking``, ``idml.models``, ``idml.data``, ``idml.evaluation``), and no library module imports
``idml.app`` (``tests/test_layering.py`` checks it).
"""
