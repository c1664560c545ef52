"""averaging"""
