"""Model families, one module each; only the registry (:mod:`theseus.jobs`) imports them."""
