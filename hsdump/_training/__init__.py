"""The training side: batches for drafter training (``batching``), exports to the formats
SpecForge and speculators read (``export``, ``trainers``, ``rows``), and the check of a store
against a transformers forward (``verify_model``)."""
