"""What every op family shares and no kernel needs: the `precision=` vocabulary, the
epilogue activations, the primitive machinery (x64 guard, interpret effects, symbolic
zeros). Imports nothing else of the package."""
