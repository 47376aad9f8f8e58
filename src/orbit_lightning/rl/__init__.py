"""The pieces of one RL step that the LightningModule orchestrates: typed batches, phases, loss."""
