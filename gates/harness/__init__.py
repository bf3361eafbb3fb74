"""What model gate suites share: loading a checkpoint the way `infer serve` does, driving its
scheduler to completion, scoring with transformers as the reference, and comparing log-probs."""
