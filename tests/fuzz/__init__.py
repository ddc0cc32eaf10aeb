"""Coverage-guided fuzzing of what reads untrusted bytes: the weight codec and its part stream, the
Generate and TrainStep validators, the OpenAI HTTP face (``targets``; run by ``runner`` under atheris,
seeded from ``corpus/<target>/``, written by ``seeds``)."""
