"""Training side of the indexer (DESIGN.md §14): the KL loss between the main attention's target and the
indexer's softmax. ``triton.indexer_kl_triton`` is the CUDA backend (import it explicitly: importing this
package never imports Triton)."""
