"""steptimer's GPU benchmark suite: overhead against a bare loop, and truth against CUPTI."""
