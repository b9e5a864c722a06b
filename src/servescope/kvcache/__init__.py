"""servescope.kvcache"""
